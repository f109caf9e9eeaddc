"""MLA's inference-time KV cache: the compressed latent, and attention over it with the
absorbed up-projections (DeepSeek-V2/V3's inference form).

Training's `MLA` expands the normed latent `c_kv` [kv_rank] into per-head keys and values with
`kv_b_proj`. At inference the cache keeps only what the expansion starts from, per layer, batch
row and position: `c_kv` and the rotated rope key shared by every head, `kv_lora_rank +
qk_rope_head_dim` numbers (DeepSeek-V3: 576) instead of `heads * (qk_head_dim + v_head_dim)`
(40,960). `kv_b_proj` is split per head into a key half W_UK [kv_rank nope] and a value half
W_UV [kv_rank v], which are moved off the cache side of each product:

    q_nope . (c_kv W_UK) = (q_nope W_UK^T) . c_kv        scores against the latent directly
    sum_t p_t (c_kv[t] W_UV) = (sum_t p_t c_kv[t]) W_UV   values summed in the latent first

The same function as `MLA.__call__`, with its sums taken in another order (float32 rounding
apart). Grouped-query attention (`attention_type` "gqa") caches its rotated keys and values
(`HeadCache`) and attends with the function its training forward uses (`dropless.nn.attend`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dropless.nn._attention import GQA
from dropless.nn._mla import MLA


class LatentCache(eqx.Module):
    """One stack's cache: `latent[l, b, t]` is layer l's normed `c_kv` of row b at position t,
    `k_rope[l, b, t]` its rotated rope key. Slots past the positions written hold anything."""

    latent: Float[Array, "layers batch cache kv_rank"]
    k_rope: Float[Array, "layers batch cache rope"]


class HeadCache(eqx.Module):
    """One stack's grouped-query cache: layer l's rotated keys `k[l, b, t]` and values
    `v[l, b, t]` of row b at position t. Slots past the positions written hold anything."""

    k: Float[Array, "layers batch cache kv_heads head_dim"]
    v: Float[Array, "layers batch cache kv_heads head_dim"]


class KVCache(eqx.Module):
    """The cache of a `DeepSeekV3`: one `LatentCache` (MLA) or `HeadCache` (GQA) per decoder
    stack (None where the model has no such stack), laid out like the model's own stacks so
    that one scan walks both."""

    dense: LatentCache | HeadCache | None
    moe: LatentCache | HeadCache | None

    @property
    def length(self) -> int:
        """Positions the cache holds (its static capacity, not how many are written)."""
        stack = self.dense if self.dense is not None else self.moe
        return jax.tree.leaves(stack)[0].shape[2]


def init_cache(model, batch: int, length: int, dtype=None) -> KVCache:
    """A zero cache for `batch` rows of up to `length` positions, in `dtype` (default: the
    model's compute dtype). `model` is a `DeepSeekV3`."""
    c = model.config
    dtype = c.compute_jnp_dtype if dtype is None else dtype

    def stack(n: int) -> LatentCache | HeadCache | None:
        if n == 0:
            return None
        if c.attention_type == "gqa":
            shape = (n, batch, length, c.kv_heads, c.gqa_head_dim)
            return HeadCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        return LatentCache(
            jnp.zeros((n, batch, length, c.kv_lora_rank), dtype),
            jnp.zeros((n, batch, length, c.qk_rope_head_dim), dtype),
        )

    return KVCache(stack(c.n_dense_layers), stack(c.n_moe_layers))


def latent_kv(
    attn: MLA, x: Float[Array, "batch seq dim"], positions: Int[Array, " seq"]
) -> tuple[Float[Array, "batch seq kv_rank"], Float[Array, "batch seq rope"]]:
    """What the cache keeps of `x` at `positions`: the normed latent and the rotated rope key."""
    kv_a = x @ attn.kv_a_proj_with_mqa.astype(x.dtype)
    latent = attn.kv_a_layernorm(kv_a[..., : attn.kv_lora_rank])
    k_rope = jax.vmap(attn.rope, in_axes=(0, None))(kv_a[..., attn.kv_lora_rank :], positions)
    return latent, k_rope


def absorbed_attention(
    attn: MLA,
    x: Float[Array, "batch seq dim"],
    positions: Int[Array, " seq"],
    latent: Float[Array, "batch cache kv_rank"],
    k_rope: Float[Array, "batch cache rope"],
) -> Float[Array, "batch seq dim"]:
    """`attn`'s output for queries `x` at `positions`, each attending to the cached positions
    at or before its own (the cache must already hold the queries' own entries)."""
    dt = x.dtype
    batch, seq, _ = x.shape
    h, nope, v = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    if attn.q_proj is None:
        q = attn.q_a_layernorm(x @ attn.q_a_proj.astype(dt)) @ attn.q_b_proj.astype(dt)
    else:
        q = x @ attn.q_proj.astype(dt)
    q = q.reshape(batch, seq, h, nope + attn.qk_rope_head_dim)
    q_rope = jax.vmap(attn.rope, in_axes=(0, None))(q[..., nope:], positions)
    w_kv = attn.kv_b_proj.astype(dt).reshape(attn.kv_lora_rank, h, nope + v)
    w_uk, w_uv = w_kv[..., :nope], w_kv[..., nope:]
    latent, k_rope = latent.astype(dt), k_rope.astype(dt)
    # The absorbed query, accumulated in float32 and kept in the compute dtype, like the
    # cache it is scored against.
    q_latent = jnp.einsum("bshd,rhd->bshr", q[..., :nope], w_uk, preferred_element_type=jnp.float32)
    scores = jnp.einsum(
        "bshr,btr->bhst", q_latent.astype(dt), latent, preferred_element_type=jnp.float32
    )
    scores += jnp.einsum("bshd,btd->bhst", q_rope, k_rope, preferred_element_type=jnp.float32)
    visible = jnp.arange(latent.shape[1])[None, :] <= positions[:, None]  # [seq cache]
    scores = jnp.where(visible, scores * attn.scale, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out_latent = jnp.einsum("bhst,btr->bshr", probs, latent)
    out = jnp.einsum("bshr,rhv->bshv", out_latent, w_uv)
    return out.reshape(batch, seq, h * v) @ attn.o_proj.astype(dt)


def cached_attention(
    attn: MLA | GQA,
    x: Float[Array, "batch seq dim"],
    positions: Int[Array, " seq"],
    cache: LatentCache | HeadCache,
    layer: Int[Array, ""],
    start: Int[Array, ""],
    window: Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch seq dim"], LatentCache | HeadCache]:
    """`attn`'s output for `x` at `positions` (= start, start + 1, ...), attending to every
    cached position at or before each query's (within `window`, for GQA, if given), and
    `cache` (a whole stack's) with `x`'s entries written into layer `layer` first."""

    def write(buf, new):  # into the stack's buffer, which a scan carries: in place
        at = (layer, jnp.int32(0), start) + (jnp.int32(0),) * (buf.ndim - 3)
        return jax.lax.dynamic_update_slice(buf, new[None].astype(buf.dtype), at)

    if isinstance(attn, GQA):
        q, k, v = attn.project(x, positions)
        cache = HeadCache(write(cache.k, k), write(cache.v, v))
        keys = jnp.arange(cache.k.shape[2])
        k, v = cache.k[layer].astype(x.dtype), cache.v[layer].astype(x.dtype)
        return attn.attend(q, k, v, positions, keys, window), cache
    latent, k_rope = latent_kv(attn, x, positions)
    cache = LatentCache(write(cache.latent, latent), write(cache.k_rope, k_rope))
    out = absorbed_attention(attn, x, positions, cache.latent[layer], cache.k_rope[layer])
    return out, cache
