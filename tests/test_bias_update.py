"""Bias-update rules (`dropless.bias_update`): their invariants, property-based, against a
direct numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless.balance import update_expert_bias
from dropless.bias_update import (
    BIAS_UPDATES,
    AbstractBiasUpdate,
    ProportionalBiasUpdate,
    SignBiasUpdate,
)

loads = st.lists(st.integers(0, 50), min_size=2, max_size=12)
rates = st.sampled_from([0.0, 1e-3, 0.05])


def reference(rule: str, bias, load, rate, target=None):
    bias, load = np.asarray(bias, np.float64), np.asarray(load, np.float64)
    target = np.full_like(load, load.mean()) if target is None else np.asarray(target, np.float64)
    error = target - load
    if rule == "sign":
        return bias + rate * np.sign(error)
    return bias + rate * error / np.maximum(target, 1e-9)


@given(loads, rates, st.sampled_from(["sign", "proportional"]))
def test_rules_equal_the_reference(load, rate, rule):
    bias = np.linspace(-0.3, 0.3, len(load))
    got = BIAS_UPDATES[rule](jnp.asarray(bias, jnp.float32), jnp.asarray(load, jnp.float32), rate)
    np.testing.assert_allclose(got, reference(rule, bias, load, rate), rtol=1e-5, atol=1e-6)


@given(loads, st.sampled_from(list(BIAS_UPDATES.values())))
def test_under_loaded_experts_rise_over_loaded_fall_balanced_stay(load, rule):
    load = jnp.asarray(load, jnp.float32)
    bias = jnp.zeros_like(load)
    step = rule(bias, load, 0.01)
    mean = load.mean()
    assert bool(jnp.all(jnp.where(load < mean, step > 0, True)))
    assert bool(jnp.all(jnp.where(load > mean, step < 0, True)))
    assert bool(jnp.all(jnp.where(load == mean, step == 0, True)))
    balanced = jnp.full_like(load, 7.0)
    np.testing.assert_array_equal(rule(bias, balanced, 0.01), bias)
    np.testing.assert_array_equal(rule(bias + 0.2, load, 0.0), bias + 0.2)  # rate 0: no move


@given(loads)
def test_proportional_moves_in_proportion_to_the_relative_error(load):
    load = jnp.asarray(load, jnp.float32)
    one = ProportionalBiasUpdate()(jnp.zeros_like(load), load, 0.01)
    two = ProportionalBiasUpdate()(jnp.zeros_like(load), load, 0.02)
    np.testing.assert_allclose(two, 2 * one, rtol=1e-6, atol=1e-9)


def test_sign_rule_is_update_expert_bias_and_works_on_stacked_layers():
    load = jnp.asarray([[1.0, 5.0, 3.0], [2.0, 2.0, 2.0]])
    bias = jnp.zeros((2, 3))
    got = SignBiasUpdate()(bias, load, 0.1)
    np.testing.assert_allclose(got, [[0.1, -0.1, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(got, update_expert_bias(bias, load, 0.1))


def test_a_target_other_than_the_mean():
    load = jnp.asarray([4.0, 4.0, 2.0])
    target = jnp.asarray([4.0, 2.0, 4.0])
    got = SignBiasUpdate()(jnp.zeros(3), load, 1.0, target)
    np.testing.assert_array_equal(got, [0.0, -1.0, 1.0])
    got = ProportionalBiasUpdate()(jnp.zeros(3), load, 1.0, target)
    np.testing.assert_allclose(got, [0.0, -1.0, 0.5])


def test_rules_are_values_and_shapes_are_checked():
    assert isinstance(SignBiasUpdate(), AbstractBiasUpdate)
    assert SignBiasUpdate() == SignBiasUpdate()
    with pytest.raises((ValueError, TypeError)):
        SignBiasUpdate()(jnp.zeros(3), jnp.zeros(4), 0.1)  # jaxtyping may say so first
