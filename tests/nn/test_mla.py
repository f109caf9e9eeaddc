"""Multi-head latent attention against a naive per-head attention with the up-projections
materialised and RoPE written as explicit 2x2 rotations; causality by gradients."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.nn import MLA, BlockwiseAttention, CudnnAttention, XlaAttention, cudnn_attention

DIM, HEADS, NOPE, ROPE, V, KV_RANK = 32, 3, 8, 6, 10, 12
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def make_mla(q_lora_rank, interleave=True, rope_scaling=None, key=0, attention=XlaAttention()):  # noqa: B008
    mla = MLA(
        DIM,
        HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        rope_scaling=rope_scaling,
        max_position_embeddings=64,
        rope_interleave=interleave,
        attention=attention,
        key=jax.random.key(key),
    )
    # Norm weights start at one; make every array random so a misplaced norm shows.
    arrays, static = eqx.partition(mla, eqx.is_array)
    leaves, tree = jax.tree.flatten(arrays)
    keys = jax.random.split(jax.random.key(key + 100), len(leaves))
    leaves = [a + 0.3 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys, strict=True)]
    return eqx.combine(jax.tree.unflatten(tree, leaves), static)


def naive_mla(mla: MLA, x) -> np.ndarray:
    """Per batch, per query position, per head, in float64."""

    def w(a):
        return np.asarray(a, np.float64)

    def rms(v, weight, eps=1e-6):
        return v / np.sqrt(np.mean(v * v) + eps) * w(weight)

    x = np.asarray(x, np.float64)
    batch, seq, _ = x.shape
    inv_freq = np.asarray(mla.rope.inv_freq)
    scaling = mla.rope.attention_scaling
    half = ROPE // 2

    def rotate(vec, pos):
        out = vec.copy()
        for i in range(half):
            a, b = (2 * i, 2 * i + 1) if mla.rope.interleave else (i, i + half)
            angle = pos * inv_freq[i]
            rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
            out[a], out[b] = scaling * (rot @ np.array([vec[a], vec[b]]))
        return out

    kv_b = w(mla.kv_b_proj).reshape(KV_RANK, HEADS, NOPE + V)
    w_uk, w_uv = kv_b[..., :NOPE], kv_b[..., NOPE:]  # per-head up-projections [rank heads .]
    out = np.zeros((batch, seq, DIM))
    for b in range(batch):
        latent, k_rope = [], []
        for s in range(seq):
            kv_a = x[b, s] @ w(mla.kv_a_proj_with_mqa)
            latent.append(rms(kv_a[:KV_RANK], mla.kv_a_layernorm.weight))
            k_rope.append(rotate(kv_a[KV_RANK:], s))
        for t in range(seq):
            if mla.q_proj is None:
                q = rms(x[b, t] @ w(mla.q_a_proj), mla.q_a_layernorm.weight) @ w(mla.q_b_proj)
            else:
                q = x[b, t] @ w(mla.q_proj)
            q = q.reshape(HEADS, NOPE + ROPE)
            heads = []
            for h in range(HEADS):
                q_rope = rotate(q[h, NOPE:], t)
                scores = np.array(
                    [
                        q[h, :NOPE] @ (latent[s] @ w_uk[:, h]) + q_rope @ k_rope[s]
                        for s in range(t + 1)  # causal: keys 0..t only
                    ]
                )
                p = np.exp(mla.scale * scores - np.max(mla.scale * scores))
                p /= p.sum()
                heads.append(sum(p[s] * (latent[s] @ w_uv[:, h]) for s in range(t + 1)))
            out[b, t] = np.concatenate(heads) @ w(mla.o_proj)
    return out


@pytest.mark.parametrize(
    "q_lora_rank,interleave,rope_scaling",
    [(16, True, None), (None, True, None), (16, False, YARN), (None, True, YARN)],
)
def test_matches_naive_attention(q_lora_rank, interleave, rope_scaling):
    mla = make_mla(q_lora_rank, interleave, rope_scaling)
    assert (mla.q_proj is None) == (q_lora_rank is not None)
    x = jax.random.normal(jax.random.key(1), (2, 7, DIM))
    got = eqx.filter_jit(mla)(x)
    np.testing.assert_allclose(got, naive_mla(mla, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_causal_by_gradients(q_lora_rank):
    mla = make_mla(q_lora_rank, rope_scaling=YARN)
    x = jax.random.normal(jax.random.key(2), (2, 9, DIM))

    @jax.jit
    def grad_at(x, t):
        # Output of sequence 0 at position t, against every input.
        return jax.grad(lambda x: jnp.sum(mla(x)[0, t] ** 2))(x)

    for t in (0, 4, 8):
        g = np.asarray(grad_at(x, t))
        assert np.all(g[0, t + 1 :] == 0), f"position {t} sees the future"
        assert np.all(g[1] == 0), "sequences in a batch interact"
        assert np.all(np.abs(g[0, : t + 1]).sum(-1) > 0), f"position {t} misses its past"


def test_bf16_compute():
    mla = make_mla(16, rope_scaling=YARN)
    x = jax.random.normal(jax.random.key(3), (2, 8, DIM))
    got = eqx.filter_jit(mla)(x.astype(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    want = eqx.filter_jit(mla)(x)
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want))
    assert err.max() < 0.05 * np.abs(np.asarray(want)).max()


def test_parameter_shapes_use_in_out_layout():
    mla = make_mla(16)
    assert mla.q_a_proj.shape == (DIM, 16)
    assert mla.q_b_proj.shape == (16, HEADS * (NOPE + ROPE))
    assert mla.kv_a_proj_with_mqa.shape == (DIM, KV_RANK + ROPE)
    assert mla.kv_b_proj.shape == (KV_RANK, HEADS * (NOPE + V))
    assert mla.o_proj.shape == (HEADS * V, DIM)


def test_cudnn_path_assembles_heads_like_xla(monkeypatch):
    """The cuDNN path's q and k (rope written into q's own columns, the shared rope key
    broadcast per head), checked on any machine with cuDNN's call replaced by plain attention:
    output and gradients equal the XLA path's."""
    monkeypatch.setattr("dropless.nn._mla.cudnn_attention", _causal_attention)
    mla = make_mla(16, rope_scaling=YARN)
    fused = make_mla(16, rope_scaling=YARN, attention=CudnnAttention())
    x = jax.random.normal(jax.random.key(4), (2, 16, DIM))
    cotangent = jax.random.normal(jax.random.key(5), (2, 16, DIM))

    def loss(model, x):
        return jnp.sum(model(x) * cotangent)

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    (want, want_grads), (got, got_grads) = grad(mla, x), grad(fused, x)
    # The two paths sum the scores in different orders (one contraction against nope and
    # rope apart), so they agree to float32 rounding of each array's largest element.
    got, want = jax.tree.leaves((got, got_grads)), jax.tree.leaves((want, want_grads))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(w))))


@pytest.mark.gpu
def test_cudnn_matches_xla():
    mla = make_mla(16, rope_scaling=YARN)
    fused = make_mla(16, rope_scaling=YARN, attention=CudnnAttention())
    x = jax.random.normal(jax.random.key(4), (2, 64, DIM)).astype(jnp.bfloat16)
    want = np.asarray(eqx.filter_jit(mla)(x), np.float32)
    got = np.asarray(eqx.filter_jit(fused)(x), np.float32)
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)


def _causal_attention(q, k, v, scale):
    """Plain float32 causal softmax attention over `batch seq heads width`."""
    q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    seq = q.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


@pytest.mark.gpu
@pytest.mark.parametrize("mla_widths", [True, False])
def test_cudnn_attention_with_narrow_values_matches_plain_attention(mla_widths):
    """q and k 24 wide, v 16 (MLA's shape): output and gradients of both cuDNN paths (as they
    are, and zero-padded to one width) equal plain attention; only the padded one pads."""
    keys = jax.random.split(jax.random.key(5), 4)
    q, k = (jax.random.normal(kk, (2, 128, 4, 24), jnp.bfloat16) for kk in keys[:2])
    v = jax.random.normal(keys[2], (2, 128, 4, 16), jnp.bfloat16)
    cotangent = jax.random.normal(keys[3], (2, 128, 4, 16), jnp.float32)
    scale = 24**-0.5

    def loss(attention):
        return lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * cotangent)

    def fused(q, k, v):
        return cudnn_attention(q, k, v, scale, mla_widths=mla_widths)

    def plain(q, k, v):
        return _causal_attention(q, k, v, scale)

    assert (" pad[" in str(jax.make_jaxpr(fused)(q, k, v))) == (not mla_widths)
    got = jax.jit(jax.value_and_grad(loss(fused), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(loss(plain), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(
        np.asarray(fused(q, k, v), np.float32), np.asarray(plain(q, k, v)), rtol=2e-2, atol=2e-2
    )
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("q_lora_rank,seq", [(16, 37), (None, 16)])
def test_blockwise_equals_xla_values_and_gradients(q_lora_rank, seq):
    """The blockwise strategy (tiles of 8 queries x 16 keys: several per sequence, the last
    one partial) against the einsum attention: output and every weight's gradient."""
    mla = make_mla(q_lora_rank, rope_scaling=YARN)
    tiled = eqx.tree_at(lambda m: m.attention, mla, BlockwiseAttention(block_q=8, block_k=16))
    x = jax.random.normal(jax.random.key(6), (2, seq, DIM))
    cotangent = jax.random.normal(jax.random.key(7), (2, seq, DIM))

    def loss(model_and_x):
        model, x = model_and_x
        return jnp.sum(model(x) * cotangent)

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    got, want = jax.tree.leaves(grad((tiled, x))), jax.tree.leaves(grad((mla, x)))
    assert len(got) == len(want) >= 7  # the loss, x and every weight
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(w))))
