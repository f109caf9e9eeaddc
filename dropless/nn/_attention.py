"""Grouped-query attention (GQA): `num_heads` query heads share `num_kv_heads` key and value
heads, with rotary embeddings, an optional RMS norm of queries and keys and an optional sliding
window (Qwen3-MoE, Mixtral, OLMoE).

The attention itself is `attend`, one function for training (queries and keys at the same
positions) and for decoding against a cache (queries at some positions, keys at all cached
ones), so that the two agree by construction. It takes an optional learnt logit per head, an
attention sink that takes probability mass without contributing a value (gpt-oss).
Field names follow the Hugging Face checkpoints; weights are stored [in out].
"""

from collections.abc import Mapping
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from dropless._precision import f32_einsum
from dropless._swiglu import init_linear
from dropless.nn._rmsnorm import RMSNorm
from dropless.nn._rope import RotaryEmbedding

QKNorm = Literal["none", "head", "full"]
QK_NORMS = ("none", "head", "full")


def attend(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch keys kv_heads head_dim"],
    v: Float[Array, "batch keys kv_heads head_dim"],
    q_positions: Int[Array, " seq"],
    k_positions: Int[Array, " keys"],
    *,
    scale: float,
    window: int | Int[Array, ""] | None = None,
    sinks: Float[Array, " heads"] | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Causal attention of each query over the keys at or before its position (and, with
    `window`, a static or traced int, fewer than `window` positions before it), query head h
    reading key head h // (heads / kv_heads). Scores and softmax in float32; `sinks[h]` joins
    head h's softmax as one more logit with no value."""
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, dim)
    scores = f32_einsum("bsngd,btnd->bngst", q, k) * scale
    visible = k_positions[None, :] <= q_positions[:, None]
    if window is not None:
        visible &= q_positions[:, None] - k_positions[None, :] < window
    scores = jnp.where(visible, scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = sinks.astype(jnp.float32).reshape(1, kv_heads, heads // kv_heads, 1, 1)
        top = jnp.maximum(scores.max(-1, keepdims=True), sink)
        e = jnp.exp(scores - top)
        probs = e / (e.sum(-1, keepdims=True) + jnp.exp(sink - top))
    out = jnp.einsum("bngst,btnd->bsngd", probs.astype(v.dtype), v)
    return out.reshape(batch, seq, heads, dim)


class GQA(eqx.Module):
    """Causal grouped-query attention over `batch seq dim`.

    `qk_norm`: "head" norms each head's query and key over `head_dim` (Qwen3), "full" the whole
    query and key projections (OLMoE), before the rotation either way; the rotation turns
    half-split pairs (x[i], x[i + head_dim/2]) as these families do, or with `rope_interleave`
    adjacent ones (`dropless.nn.RotaryEmbedding`). `window`: each position
    sees itself and the `window - 1` before it (None: all before it). `impl`: "xla" (`attend`)
    or "cudnn" (cuDNN's fused attention on NVIDIA GPUs, through `jax.nn.dot_product_attention`).
    `bias`: the four projections add a bias (`q_bias`, ...). `sinks`: a learnt logit per query
    head joins its softmax (`attend`); both as in gpt-oss. A `window` passed at the call (a
    traced int, one per layer of a stack) overrides the static one.
    """

    q_proj: Float[Array, "dim q_out"]
    k_proj: Float[Array, "dim kv_out"]
    v_proj: Float[Array, "dim kv_out"]
    o_proj: Float[Array, "q_out dim"]
    q_bias: Float[Array, " q_out"] | None
    k_bias: Float[Array, " kv_out"] | None
    v_bias: Float[Array, " kv_out"] | None
    o_bias: Float[Array, " dim"] | None
    sinks: Float[Array, " heads"] | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    rope: RotaryEmbedding
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    qk_norm: QKNorm = eqx.field(static=True)
    window: int | None = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    impl: str = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: QKNorm = "none",
        window: int | None = None,
        bias: bool = False,
        sinks: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: Mapping[str, Any] | None = None,
        max_position_embeddings: int = 2048,
        rope_interleave: bool = False,
        eps: float = 1e-6,
        impl: str = "xla",
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of {num_kv_heads=}")
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm ({qk_norm!r}) must be one of {QK_NORMS}")
        k_q, k_k, k_v, k_o = jax.random.split(key, 4)
        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj = init_linear(k_q, (dim, q_out), dim, dtype)
        self.k_proj = init_linear(k_k, (dim, kv_out), dim, dtype)
        self.v_proj = init_linear(k_v, (dim, kv_out), dim, dtype)
        self.o_proj = init_linear(k_o, (q_out, dim), q_out, dtype)
        zeros = (lambda n: jnp.zeros((n,), dtype)) if bias else (lambda n: None)
        self.q_bias, self.k_bias, self.v_bias = zeros(q_out), zeros(kv_out), zeros(kv_out)
        self.o_bias = zeros(dim)
        self.sinks = jnp.zeros((num_heads,), dtype) if sinks else None
        if sinks and impl == "cudnn":
            raise ValueError("attention sinks need impl 'xla' (cuDNN's attention has none)")
        q_width, k_width = (head_dim, head_dim) if qk_norm == "head" else (q_out, kv_out)
        norms = qk_norm != "none"
        self.q_norm = RMSNorm(q_width, eps=eps, dtype=dtype) if norms else None
        self.k_norm = RMSNorm(k_width, eps=eps, dtype=dtype) if norms else None
        self.rope = RotaryEmbedding(
            head_dim,
            theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            interleave=rope_interleave,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qk_norm, self.window, self.scale, self.impl = qk_norm, window, head_dim**-0.5, impl

    def project(
        self, x: Float[Array, "batch seq dim"], positions: Int[Array, " seq"]
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """Rotated (and normed) queries and keys, and values, of `x` at `positions`."""
        batch, seq, _ = x.shape
        q, k, v = (
            _linear(x, w, b)
            for w, b in (
                (self.q_proj, self.q_bias),
                (self.k_proj, self.k_bias),
                (self.v_proj, self.v_bias),
            )
        )
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(batch, seq, self.num_heads, self.head_dim)
        k = k.reshape(batch, seq, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        rope = jax.vmap(self.rope, in_axes=(0, None))  # over batch
        v = v.reshape(batch, seq, self.num_kv_heads, self.head_dim)
        return rope(q, positions), rope(k, positions), v

    def attend(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch keys kv_heads head_dim"],
        v: Float[Array, "batch keys kv_heads head_dim"],
        q_positions: Int[Array, " seq"],
        k_positions: Int[Array, " keys"],
        window: Int[Array, ""] | None = None,
    ) -> Float[Array, "batch seq dim"]:
        """`attend` with this layer's settings (`window`, if given, in place of its own), then
        the output projection."""
        out = attend(
            q,
            k,
            v,
            q_positions,
            k_positions,
            scale=self.scale,
            window=self.window if window is None else window,
            sinks=self.sinks,
        )
        batch, seq = q.shape[:2]
        return _linear(out.reshape(batch, seq, -1), self.o_proj, self.o_bias)

    def __call__(
        self, x: Float[Array, "batch seq dim"], window: Int[Array, ""] | None = None
    ) -> Float[Array, "batch seq dim"]:
        """Causal self-attention; position i attends to positions 0..i (within the window:
        `window`, if given, in place of the layer's own)."""
        positions = jnp.arange(x.shape[1])
        with jax.named_scope("qkv"):
            q, k, v = self.project(x, positions)
        with jax.named_scope("attention"):
            if self.impl == "cudnn":
                if window is not None:
                    raise ValueError("a window per call needs impl 'xla'")
                return self._fused(q, k, v, "cudnn")
            return self.attend(q, k, v, positions, positions, window)

    def _fused(self, q, k, v, implementation: str | None):
        window = None if self.window is None else (self.window - 1, 0)
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            scale=self.scale,
            is_causal=True,
            local_window_size=window,
            implementation=implementation,
        )
        batch, seq = q.shape[:2]
        return _linear(out.reshape(batch, seq, -1), self.o_proj, self.o_bias)


def _linear(x: Array, w: Array, b: Array | None) -> Array:
    """x @ w (+ b), the weights cast to x's dtype."""
    y = x @ w.astype(x.dtype)
    return y if b is None else y + b.astype(x.dtype)
