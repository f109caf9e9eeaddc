"""Multi-head latent attention (DeepSeek-V2/V3), causal, for training (no KV cache).

Keys and values come from a shared low-rank latent: `kv_a_proj_with_mqa` maps x to
[latent (kv_lora_rank) | k_rope (qk_rope_head_dim)], the latent is normed and expanded by
`kv_b_proj` into per-head [k_nope | v]. Queries come from `q_proj`, or through the low-rank
`q_a_proj -> q_a_layernorm -> q_b_proj` when `q_lora_rank` is set. Each head's query and key are
[nope | rope]; the rope part of the key is one vector shared by every head (decoupled RoPE).
Field names follow the Hugging Face checkpoint; weights are stored [in out].
"""

from collections.abc import Mapping
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from dropless.nn.rmsnorm import RMSNorm
from dropless.nn.rope import RotaryEmbedding, softmax_scale
from dropless.precision import f32_einsum
from dropless.swiglu import init_linear

AttentionImpl = Literal["xla", "cudnn"]


class MLA(eqx.Module):
    """Causal multi-head latent attention over `batch seq dim`."""

    q_proj: Float[Array, "dim q_out"] | None
    q_a_proj: Float[Array, "dim q_rank"] | None
    q_a_layernorm: RMSNorm | None
    q_b_proj: Float[Array, "q_rank q_out"] | None
    kv_a_proj_with_mqa: Float[Array, "dim kv_a_out"]
    kv_a_layernorm: RMSNorm
    kv_b_proj: Float[Array, "kv_rank kv_b_out"]
    o_proj: Float[Array, "o_in dim"]
    rope: RotaryEmbedding
    num_heads: int = eqx.field(static=True)
    qk_nope_head_dim: int = eqx.field(static=True)
    qk_rope_head_dim: int = eqx.field(static=True)
    v_head_dim: int = eqx.field(static=True)
    kv_lora_rank: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    impl: AttentionImpl = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope_theta: float = 10000.0,
        rope_scaling: Mapping[str, Any] | None = None,
        max_position_embeddings: int = 2048,
        rope_interleave: bool = True,
        eps: float = 1e-6,
        impl: AttentionImpl = "xla",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        k_q, k_qa, k_qb, k_kva, k_kvb, k_o = jax.random.split(key, 6)
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        q_out = num_heads * qk_head_dim
        if q_lora_rank is None:
            self.q_proj = init_linear(k_q, (dim, q_out), dim, dtype)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = init_linear(k_qa, (dim, q_lora_rank), dim, dtype)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=eps, dtype=dtype)
            self.q_b_proj = init_linear(k_qb, (q_lora_rank, q_out), q_lora_rank, dtype)
        kv_a_out = kv_lora_rank + qk_rope_head_dim
        self.kv_a_proj_with_mqa = init_linear(k_kva, (dim, kv_a_out), dim, dtype)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=eps, dtype=dtype)
        kv_b_out = num_heads * (qk_nope_head_dim + v_head_dim)
        self.kv_b_proj = init_linear(k_kvb, (kv_lora_rank, kv_b_out), kv_lora_rank, dtype)
        self.o_proj = init_linear(k_o, (num_heads * v_head_dim, dim), num_heads * v_head_dim, dtype)
        self.rope = RotaryEmbedding(
            qk_rope_head_dim,
            theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            interleave=rope_interleave,
        )
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = softmax_scale(qk_head_dim, rope_scaling)
        self.impl = impl

    def __call__(self, x: Float[Array, "batch seq dim"]) -> Float[Array, "batch seq dim"]:
        """Causal self-attention; position i attends to positions 0..i of its own sequence."""
        dt = x.dtype
        batch, seq, _ = x.shape
        h, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        positions = jnp.arange(seq)
        rope_batched = jax.vmap(self.rope, in_axes=(0, None))  # over batch
        with jax.named_scope("q"):
            if self.q_proj is None:
                q = self.q_a_layernorm(x @ self.q_a_proj.astype(dt)) @ self.q_b_proj.astype(dt)
            else:
                q = x @ self.q_proj.astype(dt)
            q = q.reshape(batch, seq, h, nope + rope)
            q_rope = rope_batched(q[..., nope:], positions)
        with jax.named_scope("kv"):
            kv_a = x @ self.kv_a_proj_with_mqa.astype(dt)
            latent = self.kv_a_layernorm(kv_a[..., : self.kv_lora_rank])
            k_rope = rope_batched(kv_a[..., self.kv_lora_rank :], positions)
            kv = (latent @ self.kv_b_proj.astype(dt)).reshape(batch, seq, h, nope + self.v_head_dim)
            k_nope, v = kv[..., :nope], kv[..., nope:]
        with jax.named_scope("attention"):
            if self.impl == "cudnn":
                out = self._cudnn(q, q_rope, k_nope, k_rope, v)
            else:
                out = self._xla(q[..., :nope], q_rope, k_nope, k_rope, v)
        return out.reshape(batch, seq, h * self.v_head_dim) @ self.o_proj.astype(dt)

    def _xla(self, q_nope, q_rope, k_nope, k_rope, v):
        # Scores in float32 (backward matmuls in the input dtype); the shared rope key is
        # contracted without broadcasting it per head.
        scores = f32_einsum("bqhd,bkhd->bhqk", q_nope, k_nope)
        scores += f32_einsum("bqhd,bkd->bhqk", q_rope, k_rope)
        seq = scores.shape[-1]
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(causal, scores * self.scale, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)

    def _cudnn(self, q, q_rope, k_nope, k_rope, v):
        # The rotated part is written over the projection's own rope columns: an update of
        # those columns only (a third of q at DeepSeek-V3's 128 + 64), where a concatenation
        # of q's two parts would copy all of it.
        q = q.at[..., self.qk_nope_head_dim :].set(q_rope)
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (*k_nope.shape[:3], k_rope.shape[-1]))
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        return cudnn_attention(q, k, v, self.scale)


def cudnn_attention(
    q: Float[Array, "batch seq heads qk"],
    k: Float[Array, "batch seq heads qk"],
    v: Float[Array, "batch seq heads dv"],
    scale: float,
    *,
    mla_widths: bool = True,
) -> Float[Array, "batch seq heads dv"]:
    """cuDNN's fused causal attention.

    MLA's value heads are narrower than its query and key heads (DeepSeek-V3: 128 against 192).
    `jax.nn.dot_product_attention` asks for one width, so the fallback zero-pads q, k and v to
    a common multiple of 8 (zeros change neither q.k nor p@v) and slices the output, which
    costs the padded columns in p@v and its gradients plus the copies. cuDNN >= 9.10 on Hopper
    takes the two widths as they are, through JAX's cuDNN entry point: used when
    `mla_widths` and both widths are multiples of 8, with the padding as the fallback where
    that entry point is missing or declines the shapes.
    """
    dv = v.shape[-1]
    if mla_widths and dv != q.shape[-1] and dv % 8 == 0 and q.shape[-1] % 8 == 0:
        try:
            from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

            return dot_product_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL)
        except (ImportError, NotImplementedError):
            pass
    width = -(-max(q.shape[-1], dv) // 8) * 8

    def pad(t):
        return jnp.pad(t, ((0, 0), (0, 0), (0, 0), (0, width - t.shape[-1])))

    out = jax.nn.dot_product_attention(
        pad(q), pad(k), pad(v), scale=scale, is_causal=True, implementation="cudnn"
    )
    return out[..., :dv]
