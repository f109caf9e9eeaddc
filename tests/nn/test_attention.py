"""Grouped-query attention against a naive loop over heads and positions (windows, sinks, QK
norms), and its fused path (jax.nn.dot_product_attention) against `attend`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from dropless.nn import GQA, attend

B, S, H, KV, D = 2, 9, 4, 2, 8


def naive(q, k, v, q_pos, k_pos, scale, window=None, sinks=None):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            g = h // (q.shape[2] // k.shape[2])
            for i, p in enumerate(q_pos):
                keys = [
                    j for j, t in enumerate(k_pos) if t <= p and (window is None or p - t < window)
                ]
                logits = np.array([q[b, i, h] @ k[b, j, g] * scale for j in keys])
                extra = [] if sinks is None else [float(sinks[h])]
                top = max([*logits, *extra])
                e = np.exp(logits - top)
                total = e.sum() + sum(np.exp(x - top) for x in extra)
                out[b, i, h] = sum(e[n] / total * v[b, j, g] for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("window", [None, 1, 4])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_attend_equals_naive(window, with_sinks):
    kq, kk, kv, ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, S, H, D))
    k = jax.random.normal(kk, (B, S, KV, D))
    v = jax.random.normal(kv, (B, S, KV, D))
    sinks = jax.random.normal(ks, (H,)) if with_sinks else None
    pos = jnp.arange(S)
    got = attend(q, k, v, pos, pos, scale=0.3, window=window, sinks=sinks)
    np.testing.assert_allclose(
        got, naive(q, k, v, pos, pos, 0.3, window, sinks), rtol=1e-5, atol=1e-6
    )
    # queries at later positions against a longer key buffer (decoding): the same rule
    q_pos, k_pos = jnp.array([5, 6]), jnp.arange(12)
    k2 = jax.random.normal(kk, (B, 12, KV, D))
    v2 = jax.random.normal(kv, (B, 12, KV, D))
    got = attend(q[:, :2], k2, v2, q_pos, k_pos, scale=0.3, window=window, sinks=sinks)
    want = naive(q[:, :2], k2, v2, q_pos, k_pos, 0.3, window, sinks)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
@pytest.mark.parametrize("window", [None, 3])
def test_gqa_layer_equals_naive(qk_norm, window):
    layer = GQA(16, H, KV, D, qk_norm=qk_norm, window=window, key=jax.random.key(1))
    if layer.q_norm is not None:  # weights away from 1, so that a skipped norm would show
        norms = (layer.q_norm.weight, layer.k_norm.weight)
        new = [
            jax.random.uniform(jax.random.key(2), w.shape, minval=0.5, maxval=1.5) for w in norms
        ]
        layer = eqx.tree_at(lambda m: (m.q_norm.weight, m.k_norm.weight), layer, tuple(new))
    x = jax.random.normal(jax.random.key(3), (B, S, 16))
    pos = jnp.arange(S)

    def rms(a, w):
        return a / np.sqrt(np.mean(a * a, -1, keepdims=True) + 1e-6) * np.asarray(w)

    xs = np.asarray(x, np.float64)
    q, k, v = (xs @ np.asarray(w) for w in (layer.q_proj, layer.k_proj, layer.v_proj))
    if qk_norm == "full":
        q, k = rms(q, layer.q_norm.weight), rms(k, layer.k_norm.weight)
    q, k, v = q.reshape(B, S, H, D), k.reshape(B, S, KV, D), v.reshape(B, S, KV, D)
    if qk_norm == "head":
        q, k = rms(q, layer.q_norm.weight), rms(k, layer.k_norm.weight)
    # half-split rotation (x[i], x[i + D/2]) by position * theta^(-2i/D)
    inv = 1.0 / 10000.0 ** (np.arange(0, D, 2) / D)
    ang = np.arange(S)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]

    def rot(a):
        a1, a2 = a[..., : D // 2], a[..., D // 2 :]
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], -1)

    heads = naive(rot(q), rot(k), v, pos, pos, D**-0.5, window)
    want = heads.reshape(B, S, H * D) @ np.asarray(layer.o_proj)
    np.testing.assert_allclose(layer(x), want, rtol=1e-4, atol=1e-5)
    # the fused path, run by XLA here (cuDNN on a GPU), agrees
    q, k, v = layer.project(x, pos)
    np.testing.assert_allclose(layer._fused(q, k, v, "xla"), layer(x), rtol=1e-5, atol=1e-6)


def test_bad_settings():
    with pytest.raises(ValueError, match="multiple of"):
        GQA(16, 4, 3, 8, key=jax.random.key(0))
    # with the tests' runtime type checks on, the annotation may object first
    with pytest.raises((ValueError, TypeCheckError), match="qk_norm"):
        GQA(16, 4, 2, 8, qk_norm="rms", key=jax.random.key(0))


def test_window_per_call_overrides_the_layers():
    """A traced window at the call (one per layer of a stack, gpt-oss) is the static one; a
    window wider than the sequence is full attention."""
    x = jax.random.normal(jax.random.key(1), (2, 12, 16))
    make = lambda window: GQA(
        16, 4, 2, 8, window=window, bias=True, sinks=True, key=jax.random.key(0)
    )  # noqa: E731
    per_call = jax.jit(lambda m, x, w: m(x, w))
    np.testing.assert_allclose(per_call(make(None), x, 4), make(4)(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(per_call(make(4), x, 2**31 - 1), make(None)(x), rtol=1e-6, atol=1e-6)
    assert not np.allclose(make(4)(x), make(None)(x))
    assert make(None).sinks.shape == (4,) and make(None).o_bias.shape == (16,)
    with pytest.raises(ValueError, match="sinks need impl 'xla'"):
        GQA(16, 4, 2, 8, sinks=True, impl="cudnn", key=jax.random.key(0))
