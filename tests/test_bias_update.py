"""Bias-update rules (`dropless._bias_update`): their invariants, property-based, against a
direct numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless import (
    AbstractBiasUpdate,
    PIDBiasUpdate,
    PIDState,
    ProportionalBiasUpdate,
    SignBiasUpdate,
    update_expert_bias,
)
from dropless._bias_update import BIAS_UPDATES

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


def pid_reference(kp, ki, kd, bias, loads, rates, targets=None):
    """The PID recurrence, step by step in float64: (bias, integral, last error) after each."""
    bias = np.asarray(bias, np.float64)
    integral, last = np.zeros_like(bias), np.zeros_like(bias)
    out = []
    for t, (load, rate) in enumerate(zip(loads, rates, strict=True)):
        load = np.asarray(load, np.float64)
        target = load.mean(-1, keepdims=True) if targets is None else targets[t]
        target = np.broadcast_to(np.asarray(target, np.float64), load.shape)
        if rate != 0:  # rate 0 is "off": bias and memory both wait
            e = (target - load) / np.maximum(target, 1e-9)
            integral = integral + e
            bias = bias + rate * (kp * e + ki * integral + kd * (e - last))
            last = e
        out.append((bias, integral, last))
    return out


gains = st.sampled_from([0.0, 0.05, 0.5, 1.0])
series = st.integers(1, 6).flatmap(
    lambda n: st.lists(st.lists(st.integers(0, 40), min_size=n, max_size=n), min_size=1, max_size=6)
)


@given(series, gains, gains, gains, st.lists(rates, min_size=6, max_size=6))
def test_pid_equals_the_recurrence_step_by_step(loads, kp, ki, kd, rate_list):
    loads = [ld + [0] for ld in loads]  # never a single expert
    rule = PIDBiasUpdate(kp=kp, ki=ki, kd=kd)
    bias = jnp.linspace(-0.2, 0.2, len(loads[0]), dtype=jnp.float32)
    want = pid_reference(kp, ki, kd, bias, loads, rate_list[: len(loads)])
    state = rule.init(bias)
    for load, rate, (w_bias, w_integral, w_last) in zip(loads, rate_list, want, strict=False):
        bias, state = rule.update(bias, jnp.asarray(load, jnp.float32), rate, state=state)
        assert isinstance(state, PIDState)
        np.testing.assert_allclose(bias, w_bias, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.integral, w_integral, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(state.error, w_last, rtol=1e-5, atol=1e-6)


def test_pid_on_stacked_layers_with_a_target():
    loads = [
        np.array([[4.0, 4.0, 2.0], [1.0, 3.0, 2.0]]),
        np.array([[5.0, 3.0, 2.0], [2.0, 2.0, 2.0]]),
    ]
    target = np.array([[4.0, 2.0, 4.0], [2.0, 2.0, 2.0]])
    rule = PIDBiasUpdate(kp=0.5, ki=0.2, kd=0.3)
    want = pid_reference(0.5, 0.2, 0.3, np.zeros((2, 3)), loads, [0.1, 0.1], [target, target])
    bias, state = jnp.zeros((2, 3)), None  # None: the rule's first state
    for load in loads:
        bias, state = rule.update(bias, jnp.asarray(load), 0.1, jnp.asarray(target), state)
    np.testing.assert_allclose(bias, want[-1][0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.integral, want[-1][1], rtol=1e-6, atol=1e-7)


@given(st.lists(st.integers(0, 9), min_size=1, max_size=5), gains, gains, gains)
def test_pid_without_error_never_moves(levels, kp, ki, kd):
    """Every expert at its target at every step: no move, and the memory stays empty."""
    rule = PIDBiasUpdate(kp=kp, ki=ki, kd=kd)
    bias = jnp.asarray([0.3, -0.1, 0.0, 0.2])
    state = rule.init(bias)
    for level in levels:
        new, state = rule.update(bias, jnp.full((4,), float(level)), 0.05, state=state)
        np.testing.assert_array_equal(new, bias)
    np.testing.assert_array_equal(state.integral, 0.0)
    np.testing.assert_array_equal(state.error, 0.0)


@given(series, rates)
def test_pid_with_kp_alone_is_the_proportional_rule(loads, rate):
    loads = [ld + [3] for ld in loads]
    pid, prop = PIDBiasUpdate(kp=1.0, ki=0.0, kd=0.0), ProportionalBiasUpdate()
    b_pid = b_prop = jnp.linspace(-0.2, 0.2, len(loads[0]), dtype=jnp.float32)
    state = pid.init(b_pid)
    for load in loads:
        load = jnp.asarray(load, jnp.float32)
        b_pid, state = pid.update(b_pid, load, rate, state=state)
        b_prop = prop(b_prop, load, rate)
        np.testing.assert_allclose(b_pid, b_prop, rtol=1e-6, atol=1e-7)


def test_pid_rate_zero_keeps_bias_and_memory():
    rule = PIDBiasUpdate(kp=1.0, ki=0.5, kd=0.5)
    bias = jnp.zeros(3)
    bias, state = rule.update(bias, jnp.asarray([1.0, 2.0, 6.0]), 0.1)
    frozen, same = rule.update(bias, jnp.asarray([6.0, 2.0, 1.0]), 0.0, state=state)
    np.testing.assert_array_equal(frozen, bias)
    np.testing.assert_array_equal(same.integral, state.integral)
    np.testing.assert_array_equal(same.error, state.error)
    # stateless rules keep no memory
    assert SignBiasUpdate().init(bias) is None
    assert ProportionalBiasUpdate().update(bias, jnp.ones(3), 0.1)[1] is None
