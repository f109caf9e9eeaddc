"""Blockwise attention against plain softmax attention (one `[heads seq seq]` score tensor),
values and gradients, over shapes, block sizes and masks; and what its backward keeps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax._src.ad_checkpoint import saved_residuals

from dropless.nn import blockwise_attention


def plain_attention(q, k, v, scale, qs, ks, causal, window):
    """softmax over every key at once, in float32; the mask as the module docstring states."""
    q, k, v, qs, ks = (t.astype(jnp.float32) for t in (q, k, v, qs, ks))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) + jnp.einsum("bqhd,bkd->bhqk", qs, ks)
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    ok = jnp.ones((q.shape[1], k.shape[1]), bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= j > i - window
    s = jnp.where(ok, s * scale, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def inputs(key, batch, seq_q, seq_k, heads, qk, shared, dv, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(key), 6)
    normal = jax.random.normal
    return (
        normal(keys[0], (batch, seq_q, heads, qk), dtype),
        normal(keys[1], (batch, seq_k, heads, qk), dtype),
        normal(keys[2], (batch, seq_k, heads, dv), dtype),
        normal(keys[3], (batch, seq_q, heads, shared), dtype),
        normal(keys[4], (batch, seq_k, shared), dtype),
        normal(keys[5], (batch, seq_q, heads, dv), jnp.float32),  # the output's cotangent
    )


def value_and_grads(attention, args, cotangent):
    def loss(*args):
        return jnp.sum(attention(*args).astype(jnp.float32) * cotangent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)


@st.composite
def cases(draw):
    causal = draw(st.booleans())
    seq_q = draw(st.integers(1, 40))
    # a causal mask relates position i of both: equal lengths; otherwise any
    seq_k = seq_q if causal else draw(st.integers(1, 40))
    window = draw(st.one_of(st.none(), st.integers(1, 40)))
    if not causal and window is not None:
        # every query must see a key (plain softmax is NaN on an empty row): keys j > i - window
        # exist for every i < seq_q when seq_k > seq_q - window
        seq_k = max(seq_k, seq_q - window + 1)
    return dict(
        batch=draw(st.integers(1, 2)),
        seq_q=seq_q,
        seq_k=seq_k,
        heads=draw(st.integers(1, 3)),
        qk=draw(st.integers(1, 9)),
        shared=draw(st.integers(0, 4)),
        dv=draw(st.integers(1, 9)),
        causal=causal,
        window=window,
        block_q=draw(st.integers(1, 16)),
        block_k=draw(st.integers(1, 16)),
        key=draw(st.integers(0, 2**16)),
    )


@pytest.mark.slow
@given(cases())
def test_equals_plain_attention_values_and_gradients(case):
    shapes = {n: case[n] for n in ("batch", "seq_q", "seq_k", "heads", "qk", "shared", "dv")}
    *args, cotangent = inputs(case["key"], **shapes)
    scale = case["qk"] ** -0.5
    mask = dict(causal=case["causal"], window=case["window"])

    def blockwise(q, k, v, qs, ks):
        blocks = dict(block_q=case["block_q"], block_k=case["block_k"])
        return blockwise_attention(q, k, v, scale, q_shared=qs, k_shared=ks, **mask, **blocks)

    def plain(q, k, v, qs, ks):
        return plain_attention(q, k, v, scale, qs, ks, **mask)

    got, want = value_and_grads(blockwise, args, cotangent), value_and_grads(plain, args, cotangent)
    # float32 rounding of sums taken in another order: relative to each array's largest entry
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        largest = float(np.max(np.abs(w), initial=0))
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * max(1.0, largest))


def test_without_a_shared_part_and_in_bfloat16():
    *args, cotangent = inputs(0, 2, 48, 48, 4, 16, 0, 8, jnp.bfloat16)
    q, k, v, qs, ks = args
    got = blockwise_attention(q, k, v, 0.25, block_q=16, block_k=8)
    assert got.dtype == jnp.bfloat16
    want = plain_attention(q, k, v, 0.25, qs, ks, causal=True, window=None)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2)
    grads = value_and_grads(
        lambda q, k, v, qs, ks: blockwise_attention(q, k, v, 0.25), args, cotangent
    )[1]
    assert [g.dtype for g in grads[:3]] == [jnp.bfloat16] * 3


def test_a_query_that_sees_no_key_gets_zeros():
    *args, cotangent = inputs(1, 1, 8, 8, 2, 4, 2, 4)
    q, k, v, qs, ks = args
    # non-causal window over keys at i - 1 and i: the first query sees key 0; with keys
    # shifted past every query (seq_k 2, window 1) queries 2.. see nothing
    out = blockwise_attention(q, k[:, :2], v[:, :2], 0.5, causal=False, window=1, block_q=4)
    assert np.all(np.isfinite(out)) and np.all(np.asarray(out[:, 2:]) == 0)
    assert np.any(np.asarray(out[:, :2]) != 0)


def test_backward_keeps_no_score_sized_array():
    """What the VJP keeps: the inputs, the output and a float32 log-sum-exp per row; no array
    has two sequence-long dimensions."""
    seq = 64
    *args, _ = inputs(2, 1, seq, seq, 2, 8, 4, 8)

    def loss(q, k, v, qs, ks):
        out = blockwise_attention(q, k, v, 0.3, q_shared=qs, k_shared=ks, block_q=16, block_k=16)
        return jnp.sum(out)

    kept = [aval for aval, _ in saved_residuals(loss, *args)]
    assert all(list(a.shape).count(seq) <= 1 for a in kept), kept
    assert any(a.shape == (1, 2, seq) and a.dtype == jnp.float32 for a in kept), kept  # the lse


@pytest.mark.parametrize("bad", [dict(window=0), dict(q_shared=jnp.zeros((1, 4, 1, 2)))])
def test_bad_arguments(bad):
    q = jnp.zeros((1, 4, 1, 2))
    with pytest.raises(ValueError, match="blockwise_attention"):
        blockwise_attention(q, q, q, 1.0, **bad)
