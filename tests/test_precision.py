import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import apply_updates, cast_for_compute, f32_einsum

SPECS = {
    "bsd,dv->bsv": ((2, 5, 16), (16, 40)),  # the LM head
    "bqhd,bkd->bhqk": ((2, 6, 3, 8), (2, 6, 8)),  # MLA's shared rope key
    "eci,eio->eco": ((4, 8, 16), (4, 16, 12)),  # capacity slots
}


def _plain(spec):
    return lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _operands(spec, dtype):
    (sa, sb), key = SPECS[spec], jax.random.key(3)
    ka, kb = jax.random.split(key)
    return jax.random.normal(ka, sa, dtype), jax.random.normal(kb, sb, dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_autodiff(spec, dtype):
    a, b = _operands(spec, dtype)
    out, vjp = jax.vjp(lambda a, b: f32_einsum(spec, a, b), a, b)
    ref_out, ref_vjp = jax.vjp(_plain(spec), a, b)
    np.testing.assert_array_equal(out, ref_out)
    assert out.dtype == jnp.float32
    g = jax.random.normal(jax.random.key(4), out.shape, jnp.float32)
    # float32: the same maths; bfloat16: the cotangent is rounded to bf16 (relative 2^-8)
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    for got, want in zip(vjp(g), ref_vjp(g), strict=True):
        assert got.dtype == want.dtype == dtype
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=tol, atol=tol * 4)


def test_backward_matmuls_run_in_the_operand_dtype(dot_generals):
    spec = "bsd,dv->bsv"
    a, b = _operands(spec, jnp.bfloat16)

    def operand_dtypes(fn):
        return [tuple(str(v.aval.dtype) for v in e.invars) for e in dot_generals(fn, a, b)]

    ours = operand_dtypes(lambda a, b: f32_einsum(spec, a, b).sum())
    plain = operand_dtypes(lambda a, b: _plain(spec)(a, b).sum())
    assert len(ours) >= 3 and all(d == ("bfloat16", "bfloat16") for d in ours)
    # the reason f32_einsum exists: autodiff's transpose contracts the float32 cotangent
    assert any("float32" in d for d in plain)


def test_mixed_dtypes_are_refused():
    a, b = _operands("bsd,dv->bsv", jnp.float32)
    with pytest.raises(TypeError, match="must share a dtype"):
        f32_einsum("bsd,dv->bsv", a, b.astype(jnp.bfloat16))


def test_cast_for_compute_casts_the_gradient_back_exactly():
    x = jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(2, 3)
    for dtype in (jnp.bfloat16, jnp.float32):
        y, pullback = jax.vjp(lambda x, dtype=dtype: cast_for_compute(x, dtype), x)
        assert y.dtype == dtype
        np.testing.assert_array_equal(y, x.astype(dtype))
        (g,) = pullback(jnp.full(y.shape, 1 / 3, dtype))
        assert g.dtype == jnp.float32
        np.testing.assert_array_equal(g, jnp.full(x.shape, 1 / 3, dtype).astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cast_for_compute_gradient_passes_a_barrier_in_the_compute_dtype(dtype):
    x = jnp.ones((2, 3), jnp.float32)
    grad = jax.grad(lambda x: jnp.sum(cast_for_compute(x, dtype).astype(jnp.float32)))
    barriers = [
        [v.aval.dtype for v in eqn.invars]
        for eqn in jax.make_jaxpr(grad)(x).eqns
        if eqn.primitive.name == "optimization_barrier"
    ]
    assert barriers == [[jnp.dtype(dtype)]]


def test_apply_updates_keeps_each_parameter_dtype():
    params = {"w": jnp.ones((3,), jnp.bfloat16), "v": jnp.ones((2,)), "frozen": jnp.zeros(2)}
    updates = {"w": jnp.full((3,), 0.25, jnp.float32), "v": jnp.full((2,), 0.5), "frozen": None}
    new = apply_updates(params, updates)
    assert new["w"].dtype == jnp.bfloat16  # p + u alone would be float32
    np.testing.assert_array_equal(new["w"], jnp.full((3,), 1.25, jnp.bfloat16))
    np.testing.assert_array_equal(new["v"], jnp.full((2,), 1.5))
    assert new["frozen"] is params["frozen"]
