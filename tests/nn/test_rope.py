"""Rotary embeddings: YaRN frequencies and scales against the formulas written out here, and the
rotation's defining properties."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.nn import RotaryEmbedding, rope_frequencies, softmax_scale, yarn_get_mscale

V3_YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def yarn_reference(dim, base, factor, original, beta_fast, beta_slow):
    """YaRN (Peng et al. 2023), per frequency index: keep frequencies that rotate more than
    beta_fast times over the original context, divide by `factor` those that rotate fewer than
    beta_slow times, and blend linearly (in index) between the rounded boundaries."""
    half = dim // 2
    base_freq = [base ** (-2 * i / dim) for i in range(half)]

    def index_with_rotations(r):  # solve original * base^(-2i/dim) / (2 pi) = r for i
        return dim * math.log(original / (2 * math.pi * r)) / (2 * math.log(base))

    lo = max(math.floor(index_with_rotations(beta_fast)), 0)
    hi = min(math.ceil(index_with_rotations(beta_slow)), dim - 1)
    out = []
    for i in range(half):
        t = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: extrapolate, 1: interpolate
        out.append((1 - t) * base_freq[i] + t * base_freq[i] / factor)
    return np.array(out)


def mscale_ref(s, m):
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0


@pytest.mark.parametrize(
    "dim,base,factor,original,fast,slow",
    [(64, 10000.0, 40, 4096, 32, 1), (8, 10000.0, 4, 512, 32, 1), (128, 500000.0, 8, 8192, 16, 2)],
)
def test_yarn_inv_freq_matches_reference(dim, base, factor, original, fast, slow):
    scaling = {
        "type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": fast,
        "beta_slow": slow,
    }
    inv_freq, _ = rope_frequencies(dim, base, scaling, factor * original)
    want = yarn_reference(dim, base, factor, original, fast, slow)
    np.testing.assert_allclose(inv_freq, want, rtol=1e-12)
    base_freq = base ** (-np.arange(0, dim, 2) / dim)
    # The fastest dimension is never interpolated, the slowest always is (at these settings).
    assert inv_freq[0] == pytest.approx(base_freq[0])
    assert inv_freq[-1] == pytest.approx(base_freq[-1] / factor)


def test_default_and_linear_frequencies():
    dim, base = 16, 10000.0
    base_freq = np.array([base ** (-2 * i / dim) for i in range(dim // 2)])
    inv, scale = rope_frequencies(dim, base, None)
    np.testing.assert_allclose(inv, base_freq, rtol=1e-12)
    assert scale == 1.0
    inv, scale = rope_frequencies(dim, base, {"type": "linear", "factor": 4.0})
    np.testing.assert_allclose(inv, base_freq / 4, rtol=1e-12)
    assert scale == 1.0


@pytest.mark.parametrize(
    "mscale,mscale_all_dim,want",
    [
        (1.0, 1.0, 1.0),  # DeepSeek-V3: the two corrections cancel on cos/sin...
        (0.707, 0.707, 1.0),  # ...and DeepSeek-V2-Lite
        (1.0, 0.5, mscale_ref(40, 1.0) / mscale_ref(40, 0.5)),
        (None, None, mscale_ref(40, 1.0)),  # plain YaRN: 0.1 ln(s) + 1
    ],
)
def test_yarn_attention_scaling(mscale, mscale_all_dim, want):
    scaling = {**V3_YARN, "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    _, got = rope_frequencies(64, 10000.0, scaling, 163840)
    assert got == pytest.approx(want, rel=1e-12)


def test_yarn_explicit_attention_factor_wins():
    _, got = rope_frequencies(64, 10000.0, {**V3_YARN, "attention_factor": 0.75}, 163840)
    assert got == 0.75


def test_softmax_scale():
    # DeepSeek-V3: qk head 192, softmax scale multiplied by mscale(40, 1)^2.
    want = 192**-0.5 * (0.1 * math.log(40) + 1) ** 2
    assert softmax_scale(192, V3_YARN) == pytest.approx(want, rel=1e-12)
    assert softmax_scale(192, None) == pytest.approx(192**-0.5)
    assert softmax_scale(192, {**V3_YARN, "mscale_all_dim": 0}) == pytest.approx(192**-0.5)
    assert yarn_get_mscale(1.0, 5.0) == 1.0


def test_unknown_rope_type_is_an_error():
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        rope_frequencies(8, 10000.0, {"type": "dynamic", "factor": 2.0})


def test_odd_dimension_is_an_error():
    with pytest.raises(ValueError, match="must be even"):
        RotaryEmbedding(7)


@pytest.mark.parametrize("interleave", [True, False])
def test_rotation_is_relative_and_norm_preserving(interleave):
    rope = RotaryEmbedding(16, interleave=interleave)
    q = jax.random.normal(jax.random.key(0), (6, 16))
    k = jax.random.normal(jax.random.key(1), (6, 16))
    pos = jnp.arange(6)
    np.testing.assert_allclose(
        jnp.linalg.norm(rope(q, pos), axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5
    )
    # <rope(q, m), rope(k, n)> depends on m - n only.
    d1 = jnp.sum(rope(q, pos) * rope(k, pos + 3), -1)
    d2 = jnp.sum(rope(q, pos + 11) * rope(k, pos + 14), -1)
    np.testing.assert_allclose(d1, d2, rtol=1e-4, atol=1e-4)


def test_interleaved_equals_half_split_on_deinterleaved_input():
    x = jax.random.normal(jax.random.key(2), (5, 3, 8))
    pos = jnp.arange(5)
    deinterleave = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
    a = RotaryEmbedding(8, interleave=True)(x, pos)
    b = RotaryEmbedding(8, interleave=False)(x[..., deinterleave], pos)
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_rotation_angles_and_scaling():
    # One pair rotated by position * inv_freq, times attention_scaling, explicitly.
    scaling = {**V3_YARN, "mscale": 1.0, "mscale_all_dim": 0.5}
    rope = RotaryEmbedding(4, rope_scaling=scaling, max_position_embeddings=163840)
    inv, s = rope_frequencies(4, 10000.0, scaling, 163840)
    x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    pos = jnp.array([7])
    got = rope(x, pos)[0]
    a0, a1 = 7 * inv
    want_pair0 = s * np.array([np.cos(a0) * 1 - np.sin(a0) * 2, np.sin(a0) * 1 + np.cos(a0) * 2])
    want_pair1 = s * np.array([np.cos(a1) * 3 - np.sin(a1) * 4, np.sin(a1) * 3 + np.cos(a1) * 4])
    # Half-split output layout: [pair0.x, pair1.x, pair0.y, pair1.y].
    np.testing.assert_allclose(
        got, [want_pair0[0], want_pair1[0], want_pair0[1], want_pair1[1]], rtol=1e-5
    )
