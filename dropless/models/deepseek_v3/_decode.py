"""A `DeepSeekV3` run through its KV cache (MLA's latent one, or grouped-query attention's keys
and values): `prefill` and `decode_step`.

`prefill` runs a chunk of tokens (the prompt) through the model, filling the cache; each
`decode_step` runs one more token per row at a given position. Both attend through the cache
(`kv_cache.cached_attention`: MLA in the absorbed form) and give the logits that
`model(tokens)` gives at the same positions. MoE layers route every token as in training
(dropless; their statistics are dropped, their expert choices kept by `hidden_and_routing`).
Only the main head decodes: MTP modules are not used. The sampling loop:
`dropless.models.deepseek_v3.generate`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dropless._moe import MoE
from dropless.models.deepseek_v3._kv_cache import HeadCache, KVCache, LatentCache, cached_attention
from dropless.models.deepseek_v3._model import DeepSeekV3, split_windows


def _ffn(
    block, h: Float[Array, "batch seq dim"]
) -> tuple[Float[Array, "batch seq dim"], Int[Array, "batch seq k"] | None]:
    # As the decoder block's call, less the MoE statistics but for its expert choice.
    x = block.post_attention_layernorm(h)
    if not isinstance(block.mlp, MoE):
        return block.mlp(x), None
    batch, seq, dim = x.shape
    y, stats = block.mlp(x.reshape(batch * seq, dim), seq_len=seq, return_routing=True)
    ids = stats.expert_ids.reshape(batch, seq, -1)
    return y.reshape(batch, seq, dim).astype(h.dtype), ids


def _run_stack(stack, cache: LatentCache | HeadCache | None, h, positions, start, windows=None):
    """The stacked blocks over `h`, each writing its layer of `cache` at `start` first;
    `windows`: each layer's attention window (`split_windows`), or None. Also each MoE layer's
    expert choice, `[layers batch seq k]` (None for dense blocks or no stack)."""
    if stack is None:
        return h, cache, None
    arrays, static = eqx.partition(stack, eqx.is_array)
    n = jax.tree.leaves(cache)[0].shape[0]

    def body(carry, xs):
        h, cache = carry
        layer_arrays, i, window = xs
        block = eqx.combine(layer_arrays, static)
        out, cache = cached_attention(
            block.self_attn, block.input_layernorm(h), positions, cache, i, start, window
        )
        h = h + out
        y, ids = _ffn(block, h)
        return (h + y, cache), ids

    windows = None if windows is None else jnp.asarray(windows, jnp.int32)
    xs = (arrays, jnp.arange(n, dtype=jnp.int32), windows)
    (h, cache), ids = jax.lax.scan(body, (h, cache), xs)
    return h, cache, ids


def hidden_and_routing(
    model: DeepSeekV3, cache: KVCache, tokens: Int[Array, "batch seq"], start
) -> tuple[Float[Array, "batch seq dim"], KVCache, Int[Array, "layers batch seq k"] | None]:
    """Final normed hidden states of `tokens` at positions start, start + 1, ..., and the MoE
    layers' expert choices (None without MoE layers; unused, XLA drops them)."""
    start = jnp.asarray(start, jnp.int32)
    positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    h = jnp.take(model.embed_tokens, tokens, axis=0).astype(model.config.compute_jnp_dtype)
    dense_windows, moe_windows = split_windows(model.config)
    h, dense, _ = _run_stack(model.dense_layers, cache.dense, h, positions, start, dense_windows)
    h, moe, ids = _run_stack(model.moe_layers, cache.moe, h, positions, start, moe_windows)
    return model.norm(h), KVCache(dense, moe), ids


def _hidden(
    model: DeepSeekV3, cache: KVCache, tokens: Int[Array, "batch seq"], start
) -> tuple[Float[Array, "batch seq dim"], KVCache]:
    """Final normed hidden states of `tokens` at positions start, start + 1, ..."""
    h, cache, _ = hidden_and_routing(model, cache, tokens, start)
    return h, cache


def prefill(
    model: DeepSeekV3,
    cache: KVCache,
    tokens: Int[Array, "batch seq"],
    start: int | Int[Array, ""] = 0,
) -> tuple[Float[Array, "batch seq vocab"], KVCache]:
    """Runs `tokens` at positions `start, ..., start + seq - 1` (every position before `start`
    already cached), returning their logits (those of `model(...)` there) and the cache with
    their entries written."""
    if tokens.shape[1] > cache.length or (
        isinstance(start, int) and start + tokens.shape[1] > cache.length
    ):
        raise ValueError(
            f"prefill: positions {start}..{start} + {tokens.shape[1]} do not fit a cache of "
            f"{cache.length} positions"
        )
    h, cache = _hidden(model, cache, tokens, start)
    return model.head(h), cache


def decode_step(
    model: DeepSeekV3,
    cache: KVCache,
    token: Int[Array, " batch"],
    position: int | Int[Array, ""],
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    """One token per row at `position` (every earlier position cached): its logits, the
    scores of the token at `position + 1`, and the cache with its entry written."""
    logits, cache = prefill(model, cache, token[:, None], position)
    return logits[:, 0], cache
