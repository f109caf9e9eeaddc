"""Autoregressive decoding of a `DeepSeekV3` with its KV cache (MLA's latent one, or
grouped-query attention's keys and values).

`prefill` runs a chunk of tokens (the prompt) through the model, filling the cache; each
`decode_step` runs one more token per row at a given position. Both attend through the cache
(`kv_cache.cached_attention`: MLA in the absorbed form) and give the logits that
`model(tokens)` gives at the same positions. MoE layers route every token as in training
(dropless; their statistics are dropped). Only the main head decodes: MTP modules are not
used. `generate(..., return_routing=True)` also records the expert choice of every token it
runs through the model, in the form `model(tokens[:, :-1], replay=...)` takes (routing replay:
a later forward, or training step, routes as sampling did).

`generate` is the whole loop, compiled once per (batch, prompt bucket, cache bucket): the
prompt is right-padded to `length_bucket(prompt length)` and the cache holds
`length_bucket(prompt length + max_new_tokens)` positions, so other lengths in the same buckets,
and other sampling settings, reuse the compilation. Padding is harmless: a padded position's
cache slot is written again by the decode step at that position before any query can see it.

Prompts in a batch must have equal lengths (a `[batch seq]` array); ragged prompts raise a
ValueError. Generate them in separate calls, or group them by length.
"""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from dropless.models.deepseek_v3.kv_cache import (
    HeadCache,
    KVCache,
    LatentCache,
    cached_attention,
    init_cache,
)
from dropless.models.deepseek_v3.model import (
    DeepSeekV3,
    RoutingReplay,
    check_tokens,
    recorded_routing,
    split_windows,
)
from dropless.moe import MoE

MIN_BUCKET = 16


def length_bucket(n: int) -> int:
    """The compiled length for `n` positions: the least power of two >= n, at least 16."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


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


def _hidden_and_routing(
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
    h, cache, _ = _hidden_and_routing(model, cache, tokens, start)
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


def sample(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray,
    *,
    temperature: float | Float[Array, ""] = 0.0,
    top_k: int | Int[Array, ""] | None = None,
    top_p: float | Float[Array, ""] | None = None,
) -> Int[Array, " batch"]:
    """A token per row, in float32: the argmax when `temperature` is 0, else a draw from
    softmax(logits / temperature) restricted to the `top_k` best tokens and then to the
    smallest set of best tokens whose probability reaches `top_p` (nucleus). Tokens tied with
    the last one kept are kept too. Settings may be traced values."""
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature = jnp.asarray(temperature, jnp.float32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    k = jnp.clip(jnp.asarray(vocab if top_k is None else top_k, jnp.int32), 1, vocab)
    p = jnp.asarray(1.0 if top_p is None else top_p, jnp.float32)
    ranked = -jnp.sort(-scaled, axis=-1)  # best first
    in_top_k = jnp.arange(vocab) < k
    probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better tokens
    # A prefix of the ranking (the best token always); p >= 1 keeps all, whatever the rounding
    # of the cumulative sum.
    kept = in_top_k & ((before < p) | (p >= 1))
    threshold = jnp.take_along_axis(ranked, kept.sum(-1, keepdims=True) - 1, axis=-1)
    drawn = jax.random.categorical(key, jnp.where(scaled >= threshold, scaled, -jnp.inf), axis=-1)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)


def _generate(
    model,
    prompt,
    prompt_len,
    total,
    length,
    key,
    temperature,
    top_k,
    top_p,
    eos_id,
    fill,
    record=False,
):
    """The jitted loop: `prompt` [batch P] right-padded, `length` (static) the cache bucket;
    returns the [batch length] token buffer, valid up to `total`, and with `record` (static)
    the MoE layers' expert choices [layers batch length k], valid up to `total - 1` (the last
    token is never run), else None. Recording runs to `total` whatever `eos_id` says, so that
    every position has its choice."""
    batch, padded = prompt.shape
    cache = init_cache(model, batch, length)
    h, cache, ids = _hidden_and_routing(model, cache, prompt, 0)
    routing = None
    if record and ids is not None:
        routing = jnp.zeros((*ids.shape[:2], length, ids.shape[-1]), jnp.int32)
        routing = jax.lax.dynamic_update_slice_in_dim(routing, ids, 0, axis=2)
    last = jax.lax.dynamic_index_in_dim(h, prompt_len - 1, axis=1)  # [batch 1 dim]

    def pick(logits, position):  # the token at `position`
        return sample(
            logits,
            jax.random.fold_in(key, position),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )

    first = pick(model.head(last)[:, 0], prompt_len)
    prompt = jnp.where(jnp.arange(padded) < prompt_len, prompt, fill)
    tokens = jnp.full((batch, length), fill, jnp.int32).at[:, :padded].set(prompt)
    tokens = tokens.at[:, prompt_len].set(first)

    def cond(state):
        position, _, _, done, _ = state
        return (position < total - 1) & (record or ~jnp.all(done))

    def body(state):
        position, tokens, cache, done, routing = state
        h, cache, ids = _hidden_and_routing(model, cache, tokens[:, position, None], position)
        logits = model.head(h)[:, 0]
        nxt = jnp.where(done, eos_id, pick(logits, position + 1))
        tokens = tokens.at[:, position + 1].set(nxt)
        if routing is not None:
            routing = jax.lax.dynamic_update_slice_in_dim(routing, ids, position, axis=2)
        return position + 1, tokens, cache, done | (nxt == eos_id), routing

    state = (prompt_len, tokens, cache, first == eos_id, routing)
    _, tokens, _, _, routing = jax.lax.while_loop(cond, body, state)
    return tokens, routing


_generate_jit = eqx.filter_jit(_generate)


def generate(
    model: DeepSeekV3,
    tokens: Int[ArrayLike, "batch seq"] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key: PRNGKeyArray | None = None,
    eos_id: int | None = None,
    return_routing: bool = False,
) -> Int[Array, "batch total"] | tuple[Int[Array, "batch total"], RoutingReplay | None]:
    """`tokens` followed by `max_new_tokens` generated ones per row ([batch seq + new]).

    Greedy (argmax) at `temperature=0`; otherwise sampled (see `sample`) with `key`, one draw
    per position from `fold_in(key, position)`: the same key gives the same tokens. After a row
    writes `eos_id` it writes only `eos_id`; the loop stops early once every row has. Prompts
    must share one length (see the module docstring).

    `return_routing`: also the expert choice each MoE layer made for every token but the last
    as it was generated, `(main [layers batch*(total-1) k], None)`: what
    `model(out[:, :-1], replay=...)` takes, so that a later forward (a training step on the
    samples) routes as sampling did; None for a model without MoE layers. The loop then runs
    to the end even after every row wrote `eos_id`.
    """
    if isinstance(tokens, (list, tuple)):
        lengths = sorted({len(row) for row in tokens})
        if len(lengths) > 1:
            raise ValueError(
                f"generate: prompts must have equal lengths, got lengths {lengths}; generate "
                "each length in its own call"
            )
    prompt = np.asarray(tokens)
    check_tokens(prompt, model.config)
    batch, seq = prompt.shape
    total = seq + max_new_tokens
    if seq < 1:
        raise ValueError("generate: the prompt must hold at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens ({max_new_tokens}) must be >= 0")
    if max_new_tokens == 0 and not return_routing:
        return jnp.asarray(prompt, jnp.int32)
    limit = model.config.max_position_embeddings
    if total > limit:
        raise ValueError(
            f"generate: prompt ({seq}) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
            f"max_position_embeddings ({limit})"
        )
    if temperature < 0:
        raise ValueError(f"generate: temperature ({temperature}) must be >= 0")
    if temperature > 0 and key is None:
        raise ValueError("generate: sampling (temperature > 0) needs a key")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k ({top_k}) must be >= 1, or None")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p ({top_p}) must be in (0, 1], or None")
    if max_new_tokens == 0:  # no token generated: the prompt's own routing
        out = _routing_jit(model, jnp.asarray(prompt[:, :-1], jnp.int32)) if seq > 1 else None
        return jnp.asarray(prompt, jnp.int32), out
    padded = np.zeros((batch, length_bucket(seq)), np.int32)
    padded[:, :seq] = prompt
    # Every setting a traced array, so that none of them is part of the compilation's key.
    out, routing = _generate_jit(
        model,
        jnp.asarray(padded),
        jnp.int32(seq),
        jnp.int32(total),
        length_bucket(total),
        jax.random.key(0) if key is None else key,
        jnp.float32(temperature),
        jnp.int32(model.config.vocab_size if top_k is None else top_k),
        jnp.float32(1.0 if top_p is None else top_p),
        jnp.int32(-1 if eos_id is None else eos_id),
        jnp.int32(0 if eos_id is None else eos_id),
        return_routing,
    )
    if not return_routing:
        return out[:, :total]
    if routing is None:  # no MoE layers
        return out[:, :total], None
    ids = routing[:, :, : total - 1]
    return out[:, :total], (ids.reshape(ids.shape[0], -1, ids.shape[-1]), None)


@eqx.filter_jit
def _routing_jit(model: DeepSeekV3, tokens: Int[Array, "batch seq"]) -> RoutingReplay | None:
    out = model(tokens, return_routing=True)
    return None if model.moe_layers is None else recorded_routing(out)
