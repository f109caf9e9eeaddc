"""Unrolled loops over stacked layers: `split_layers` and its slice-by-slice gradient, and
`unrolled_scan` against `jax.lax.scan`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from dropless.nn import split_layers, unrolled_scan


def test_split_layers_indexes_every_leaf():
    stacked = {"w": jnp.arange(24.0).reshape(3, 2, 4), "i": jnp.arange(3), "none": None}
    parts = split_layers(stacked)
    assert len(parts) == 3
    for i, part in enumerate(parts):
        np.testing.assert_array_equal(part["w"], stacked["w"][i])
        assert part["i"] == i and part["none"] is None


@pytest.mark.parametrize("used", [(0, 1, 2), (1,), ()], ids=["all", "middle", "none"])
def test_split_layers_gradient_fills_every_slice(used):
    """Each layer's gradient lands in its slice, a layer the loss ignores gets zeros (its
    cotangent is a symbolic zero), whatever the buffer held before."""
    w = jnp.arange(24.0).reshape(3, 2, 4)
    cotangent = jax.random.normal(jax.random.key(0), w.shape)

    def loss(w):
        parts = split_layers(w)
        return sum(jnp.sum(parts[i] * cotangent[i]) for i in used) + 0.0 * jnp.sum(w[:0])

    want = jnp.zeros_like(w).at[jnp.asarray(used, int)].set(cotangent[jnp.asarray(used, int)])
    np.testing.assert_array_equal(jax.jit(jax.grad(loss))(w), want)


def test_split_layers_needs_one_leading_size():
    with pytest.raises(ValueError, match="same leading"):
        split_layers({"a": jnp.ones((3, 2)), "b": jnp.ones((2, 2))})
    with pytest.raises(ValueError, match="same leading"):
        split_layers({"a": jnp.ones(())})


def _body(h, layer):
    h = jnp.tanh(h @ layer["w"] + layer["b"])
    return h, {"mean": jnp.mean(h), "flag": layer["flag"]}


def _stack(n=3, dim=4):
    kw, kb = jax.random.split(jax.random.key(1))
    return {
        "w": jax.random.normal(kw, (n, dim, dim)),
        "b": jax.random.normal(kb, (n, dim)),
        "flag": jnp.arange(n) % 2 == 0,
    }


@pytest.mark.parametrize("n", [1, 3])
def test_unrolled_scan_equals_scan(n):
    stacked, x = _stack(n), jnp.ones((2, 4))
    floats = {"w": stacked["w"], "b": stacked["b"]}

    def loss(scan, floats):
        h, ys = scan(_body, x, {**floats, "flag": stacked["flag"]})
        return jnp.sum(h**2) + jnp.sum(ys["mean"]), ys

    got = jax.grad(lambda f: loss(unrolled_scan, f), has_aux=True)(floats)
    want = jax.grad(lambda f: loss(jax.lax.scan, f), has_aux=True)(floats)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        # the two compile to differently fused programs, whose float32 sums round in another
        # order: a few ulps of the leaf's largest value apart (7.9e-6 relative on a small
        # element measured on an AMD EPYC CI box; under 1e-6 on the boxes before)
        scale = float(np.max(np.abs(b))) if np.issubdtype(b.dtype, np.floating) else 0.0
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=4 * np.finfo(np.float32).eps * scale)


def test_unrolled_scan_needs_a_layer():
    with pytest.raises(ValueError, match="no layers"):
        unrolled_scan(_body, jnp.ones((2, 4)), {})


def test_unrolled_scan_under_an_explicit_mesh():
    """The gradient buffer takes the slices' sharding; an unsharded buffer would not accept
    them under explicit sharding."""
    mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        # Weights small enough that tanh does not saturate: saturated, the gradients are
        # differences of numbers near 1, and the two programs' rounding dominates them.
        w = jax.device_put(jnp.full((3, 4, 4), 0.25), NamedSharding(mesh, P(None, "model")))
        x = jnp.ones((2, 4))

        def loss(scan, w):
            h, _ = scan(lambda h, a: (jnp.tanh(h @ a), None), x, w)
            return jnp.sum(h)

        grad = jax.grad(lambda w: loss(unrolled_scan, w))
        got = jax.jit(grad)(w)
        want = jax.jit(jax.grad(lambda w: loss(jax.lax.scan, w)))(w)
        assert jax.typeof(got).sharding.spec == jax.typeof(w).sharding.spec
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert "empty" in _primitives(grad, w)  # no fill: the buffer's sharding is known


def _primitives(f, *args) -> set[str]:
    return {eqn.primitive.name for eqn in jax.make_jaxpr(f)(*args).jaxpr.eqns}


@pytest.mark.mesh8
def test_gradient_buffer_is_zeros_under_automatic_sharding():
    """Over several devices without an explicit mesh, the buffer is a broadcast of zeros, which
    XLA's partitioner shards, not an uninitialised custom call with no sharding."""
    assert jax.device_count() > 1  # tests/conftest.py: 8 CPU devices
    grad = jax.grad(lambda w: jnp.sum(jnp.stack(split_layers(w)) ** 2))
    assert "empty" not in _primitives(grad, jnp.ones((3, 4)))
