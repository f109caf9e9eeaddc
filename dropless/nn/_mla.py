"""Multi-head latent attention (DeepSeek-V2/V3), causal, for training (no KV cache).

Keys and values come from a shared low-rank latent: `kv_a_proj_with_mqa` maps x to
[latent (kv_lora_rank) | k_rope (qk_rope_head_dim)], the latent is normed and expanded by
`kv_b_proj` into per-head [k_nope | v]. Queries come from `q_proj`, or through the low-rank
`q_a_proj -> q_a_layernorm -> q_b_proj` when `q_lora_rank` is set. Each head's query and key are
[nope | rope]; the rope part of the key is one vector shared by every head (decoupled RoPE).
Field names follow the Hugging Face checkpoint; weights are stored [in out].

How the heads attend is a strategy value, `MLA(..., attention=XlaAttention())`: `XlaAttention`
(einsums; keeps float32 `[batch heads seq seq]` probabilities for the backward; the oracle),
`BlockwiseAttention` (flash-style tiles in plain JAX, keeps the output and a log-sum-exp per row)
or `CudnnAttention` (cuDNN's fused kernel, NVIDIA GPUs). `ATTENTIONS` names them for
`DeepSeekV3Config.attention_impl`.
"""

import abc
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from dropless._precision import f32_einsum
from dropless._swiglu import init_linear
from dropless.nn._blockwise_attention import blockwise_attention
from dropless.nn._rmsnorm import RMSNorm
from dropless.nn._rope import RotaryEmbedding, softmax_scale


class AbstractAttention(eqx.Module):
    """How MLA's heads attend: causal softmax(scale * q.k) @ v per head, where each query is
    `[nope | rope]` and each key is `[k_nope | k_rope]` with k_rope one vector shared by every
    head (decoupled RoPE). Query and key heads may be wider than value heads (`dv`).
    Strategies differ in memory and kernels, not in the result."""

    @abc.abstractmethod
    def __call__(
        self,
        q: Float[Array, "batch seq heads qk"],
        k_nope: Float[Array, "batch seq heads nope"],
        k_rope: Float[Array, "batch seq rope"],
        v: Float[Array, "batch seq heads dv"],
        scale: float,
    ) -> Float[Array, "batch seq heads dv"]: ...


class XlaAttention(AbstractAttention):
    """Einsum attention: float32 scores and probabilities `[batch heads seq seq]`, which the
    backward keeps (the oracle of the other strategies)."""

    def __call__(self, q, k_nope, k_rope, v, scale):
        # Scores in float32 (backward matmuls in the input dtype); the shared rope key is
        # contracted without broadcasting it per head.
        nope = k_nope.shape[-1]
        scores = f32_einsum("bqhd,bkhd->bhqk", q[..., :nope], k_nope)
        scores += f32_einsum("bqhd,bkd->bhqk", q[..., nope:], k_rope)
        seq = scores.shape[-1]
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(causal, scores * scale, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class BlockwiseAttention(AbstractAttention):
    """Flash-style attention in plain JAX (`dropless.nn.blockwise_attention`): an online
    softmax over `block_q x block_k` tiles, skipping the tiles above the diagonal; the backward
    keeps the output and a float32 log-sum-exp per row and recomputes the tiles. Runs anywhere."""

    block_q: int = eqx.field(static=True, default=512)
    block_k: int = eqx.field(static=True, default=512)

    def __call__(self, q, k_nope, k_rope, v, scale):
        nope = k_nope.shape[-1]
        return blockwise_attention(
            q[..., :nope], k_nope, v, scale, q_shared=q[..., nope:], k_shared=k_rope,
            block_q=self.block_q, block_k=self.block_k,
        )  # fmt: skip


class CudnnAttention(AbstractAttention):
    """cuDNN's fused attention (NVIDIA GPUs; `cudnn_attention`). Like the blockwise strategy,
    its backward keeps the output and a float32 softmax statistic per row."""

    def __call__(self, q, k_nope, k_rope, v, scale):
        # cuDNN takes one key per head: the shared rope key is broadcast to every head.
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (*k_nope.shape[:3], k_rope.shape[-1]))
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        return cudnn_attention(q, k, v, scale)


ATTENTIONS: dict[str, type[AbstractAttention]] = {
    "xla": XlaAttention,
    "blockwise": BlockwiseAttention,
    "cudnn": CudnnAttention,
}


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
    attention: AbstractAttention

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
        attention: AbstractAttention = XlaAttention(),  # noqa: B008 (immutable)
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        if not isinstance(attention, AbstractAttention):
            raise TypeError(f"MLA: attention must be an AbstractAttention, got {attention!r}")
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
        self.attention = attention

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
            # The rotated part is written over the projection's own rope columns: an update of
            # those columns only (a third of q at DeepSeek-V3's 128 + 64), where a concatenation
            # of q's two parts would copy all of it.
            q = q.at[..., nope:].set(q_rope)
            out = self.attention(q, k_nope, k_rope, v, self.scale)
        return out.reshape(batch, seq, h * self.v_head_dim) @ self.o_proj.astype(dt)


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
