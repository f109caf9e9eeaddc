"""Autoregressive generation from a `DeepSeekV3`: `sample` a token from logits, and `generate`,
the whole loop through the KV cache (`dropless.models.deepseek_v3._decode`).

`generate(..., return_routing=True)` also records the expert choice of every token it runs
through the model, in the form `model(tokens[:, :-1], replay=...)` takes (routing replay: a
later forward, or training step, routes as sampling did).

`generate` is compiled once per (batch, prompt bucket, cache bucket): the
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

from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.deepseek_v3._decode import hidden_and_routing
from dropless.models.deepseek_v3._kv_cache import init_cache
from dropless.models.deepseek_v3._model import (
    DeepSeekV3,
    RoutingReplay,
    check_tokens,
    recorded_routing,
)

MIN_BUCKET = 16


def length_bucket(n: int) -> int:
    """The compiled length for `n` positions: the least power of two >= n, at least 16."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


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
    h, cache, ids = hidden_and_routing(model, cache, prompt, 0)
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
        h, cache, ids = hidden_and_routing(model, cache, tokens[:, position, None], position)
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
    prompt = _prompt(tokens, model.config)
    seq = prompt.shape[1]
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens ({max_new_tokens}) must be >= 0")
    if max_new_tokens == 0 and not return_routing:
        return jnp.asarray(prompt, jnp.int32)
    _check_settings(model.config, seq, max_new_tokens, temperature, key, top_k, top_p)
    if max_new_tokens == 0:  # no token generated: the prompt's own routing
        out = _routing_jit(model, jnp.asarray(prompt[:, :-1], jnp.int32)) if seq > 1 else None
        return jnp.asarray(prompt, jnp.int32), out
    return _run(
        model,
        prompt,
        seq + max_new_tokens,
        key=key,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
        return_routing=return_routing,
    )


def _prompt(
    tokens: Int[ArrayLike, "batch seq"] | Sequence[Sequence[int]], config: DeepSeekV3Config
) -> np.ndarray:
    """`tokens` as a checked `[batch seq]` array (`check_tokens`, equal lengths, seq >= 1)."""
    if isinstance(tokens, (list, tuple)):
        lengths = sorted({len(row) for row in tokens})
        if len(lengths) > 1:
            raise ValueError(
                f"generate: prompts must have equal lengths, got lengths {lengths}; generate "
                "each length in its own call"
            )
    prompt = np.asarray(tokens)
    check_tokens(prompt, config)
    if prompt.shape[1] < 1:
        raise ValueError("generate: the prompt must hold at least one token")
    return prompt


def _check_settings(
    config: DeepSeekV3Config,
    seq: int,
    max_new_tokens: int,
    temperature: float,
    key: PRNGKeyArray | None,
    top_k: int | None,
    top_p: float | None,
) -> None:
    """Raises ValueError for a length past the model's positions or a bad sampling setting."""
    total = seq + max_new_tokens
    limit = config.max_position_embeddings
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


def _run(
    model: DeepSeekV3,
    prompt: np.ndarray,
    total: int,
    *,
    key: PRNGKeyArray | None,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    eos_id: int | None,
    return_routing: bool,
) -> Int[Array, "batch total"] | tuple[Int[Array, "batch total"], RoutingReplay | None]:
    """`generate`'s compiled loop on a checked prompt, `total` tokens long per row."""
    batch, seq = prompt.shape
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
