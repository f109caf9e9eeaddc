"""The DeepSeek-V3 language model: embeddings, dense then MoE decoder stacks, norm, head, MTP."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from dropless._moe import MoE, MoEStats
from dropless._precision import f32_einsum
from dropless._swiglu import init_linear
from dropless.backends import Backend
from dropless.models.deepseek_v3._block import DecoderBlock
from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.deepseek_v3._layers import moe_strategies, scan_blocks, stack_blocks
from dropless.models.deepseek_v3._mtp import MTP
from dropless.nn._rmsnorm import RMSNorm

RoutingReplay = tuple[Int[Array, "layers tokens k"], Int[Array, "depth tokens k"] | None]
"""Recorded expert choices of every MoE layer: main stack's, then the MTP blocks' (or None)."""


class ModelOutput(eqx.Module):
    """What a forward pass returns.

    - `logits[b, i]`: scores of `tokens[b, i + 1]`, in `config.logits_dtype`.
    - `mtp_logits[d, b, i]`: the same dtype's scores of `tokens[b, i + d + 2]` (None without
      MTP); see `dropless.models.deepseek_v3._mtp` for which positions are valid.
    - `moe_stats`: the MoE layers' `MoEStats`, each field with a leading `layers` axis (in layer
      order); zero-length when the model has no MoE layers (sums are 0, means undefined).
    - `mtp_moe_stats`: the same for the MTP blocks (leading `depth` axis), zero-length when absent.

    With `return_routing=True`, both stats also hold each layer's routing: `expert_ids` and
    `weights`, [layers batch*seq k] (token `b * seq + i` is `tokens[b, i]`).
    """

    logits: Float[Array, "batch seq vocab"]
    mtp_logits: Float[Array, "depth batch seq vocab"] | None
    moe_stats: MoEStats
    mtp_moe_stats: MoEStats


class ModelFeatures(eqx.Module):
    """A forward pass up to the vocabulary head (`DeepSeekV3.features`): what a loss that makes
    the logits itself, chunk by chunk, needs (`TrainConfig`'s model's `loss_chunk`).

    - `hidden[b, i]`: the final normed hidden state whose logits (`head_weight()`) score
      `tokens[b, i + 1]`, in the compute dtype.
    - `mtp_hidden[d, b, i]`: MTP depth d's normed hidden state (None without MTP).
    - `moe_stats`, `mtp_moe_stats`: as in `ModelOutput`.
    """

    hidden: Float[Array, "batch seq dim"]
    mtp_hidden: Float[Array, "depth batch seq dim"] | None
    moe_stats: MoEStats
    mtp_moe_stats: MoEStats


class DeepSeekV3(eqx.Module):
    """DeepSeek-V3 (and V2) causal language model.

    Parameter tree (weights stored [in out]; stacked arrays carry a leading layer axis):
    `embed_tokens [vocab dim]`, `dense_layers` (first `first_k_dense_replace` layers, stacked
    `DecoderBlock`, or None), `moe_layers` (the rest, or None), `norm`, `lm_head [dim vocab]`
    (None when tied: the head is `embed_tokens.T`), `mtp` (`MTP`, or None).

    `backend`: the MoE layers' strategies (`dropless.Backend`; its None fields, or None, keep
    `MoE`'s defaults). A name is resolved first: `backend=dropless.train.get_backend(name)`.
    """

    embed_tokens: Float[Array, "vocab dim"]
    dense_layers: DecoderBlock | None
    moe_layers: DecoderBlock | None
    norm: RMSNorm
    lm_head: Float[Array, "dim vocab"] | None
    mtp: MTP | None
    config: DeepSeekV3Config = eqx.field(static=True)

    def __init__(
        self, config: DeepSeekV3Config, *, backend: Backend | None = None, key: PRNGKeyArray
    ):
        moe_strategies(backend)  # a wrong backend fails here, even without MoE layers
        c, dt = config, config.param_jnp_dtype
        k_emb, k_dense, k_moe, k_head, k_mtp = jax.random.split(key, 5)
        # A tied table doubles as the head, so it gets the head's 1/sqrt(dim) scale.
        emb_std = c.hidden_size**-0.5 if c.tie_word_embeddings else 1.0
        self.embed_tokens = (
            emb_std * jax.random.normal(k_emb, (c.vocab_size, c.hidden_size), jnp.float32)
        ).astype(dt)
        self.dense_layers = stack_blocks(c, c.n_dense_layers, moe=False, key=k_dense)
        self.moe_layers = stack_blocks(c, c.n_moe_layers, moe=True, backend=backend, key=k_moe)
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dt)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else init_linear(k_head, (c.hidden_size, c.vocab_size), c.hidden_size, dt)
        )
        self.mtp = MTP(c, backend=backend, key=k_mtp) if c.num_nextn_predict_layers else None
        self.config = c

    def head_weight(self) -> Float[Array, "dim vocab"]:
        """The vocabulary head's `[dim vocab]` weight (the embedding's transpose when tied)."""
        return self.embed_tokens.T if self.lm_head is None else self.lm_head

    def head(self, h: Float[Array, "batch seq dim"]) -> Float[Array, "batch seq vocab"]:
        """Logits of normed hidden states (the main model's and the MTP modules'), accumulated
        in float32 and written in `config.logits_dtype`."""
        w = self.head_weight().astype(h.dtype)
        if self.config.logits_dtype == "float32":
            return f32_einsum("bsd,dv->bsv", h, w)
        return jnp.einsum("bsd,dv->bsv", h, w, preferred_element_type=self.config.logits_jnp_dtype)

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        return_routing: bool = False,
        replay: RoutingReplay | None = None,
    ) -> ModelOutput:
        """Logits, MTP logits and MoE statistics of a batch of token sequences;
        `return_routing` (a Python bool) adds every MoE layer's routing to the statistics;
        `replay` (`recorded_routing` of such an output) routes every token of every MoE layer
        to the experts recorded there instead of the router's top-k, weighted from the
        router's own scores (routing replay: sampling-time routing kept in training).

        Raises ValueError for an empty batch ([0, seq] or [batch, 0]), for sequences longer
        than `max_position_embeddings`, and, when the tokens are concrete (not traced), for ids
        outside the vocabulary. Under `jit` the ids cannot be checked without a host callback
        in the compiled step: an id outside [0, vocab_size) (-1 included) embeds as NaN, so
        its sequence's logits are NaN from its position on, never a silent clamp. Call
        `check_tokens` on the host batch to get the error (`train` does, for every batch).
        """
        return self.from_embeddings(
            self._embed(tokens), return_routing=return_routing, replay=replay
        )

    def features(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        return_routing: bool = False,
        replay: RoutingReplay | None = None,
    ) -> ModelFeatures:
        """`__call__` without the vocabulary head: the normed hidden states that the logits
        come from (`head_weight()`), for a loss that makes the logits itself."""
        emb = self._embed(tokens)
        return ModelFeatures(*self._trunk(emb, lambda h: h, return_routing, replay))

    def from_embeddings(
        self,
        emb: Float[Array, "batch seq dim"],
        *,
        return_routing: bool = False,
        replay: RoutingReplay | None = None,
    ) -> ModelOutput:
        """Everything after the embedding lookup; `emb[b, i]` is token i's embedding, in the
        compute dtype. (Tests differentiate through this to check causality.)"""
        return ModelOutput(*self._trunk(emb, self.head, return_routing, replay))

    def _embed(self, tokens: Int[Array, "batch seq"]) -> Float[Array, "batch seq dim"]:
        c = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch seq], got shape {tokens.shape}")
        if 0 in tokens.shape:
            raise ValueError(f"tokens must hold at least one token, got shape {tokens.shape}")
        if tokens.shape[1] > c.max_position_embeddings:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_position_embeddings "
                f"({c.max_position_embeddings})"
            )
        if not isinstance(tokens, jax.core.Tracer):
            check_tokens(tokens, c)
        with jax.named_scope("embed"):
            # every id outside the vocabulary (negative ones too, which would wrap) reads NaN
            outside = (tokens < 0) | (tokens >= c.vocab_size)
            ids = jnp.where(outside, c.vocab_size, tokens)
            emb = jnp.take(self.embed_tokens, ids, axis=0, mode="fill", fill_value=jnp.nan)
            return emb.astype(c.compute_jnp_dtype)

    def _trunk(self, emb, head, return_routing: bool, replay: RoutingReplay | None = None):
        """(head(final normed h), head of each MTP depth's normed h or None, MoE stats, MTP
        MoE stats): the fields of ModelOutput, or of ModelFeatures when `head` is the
        identity."""
        c = self.config
        dense_windows, moe_windows = split_windows(c)
        with jax.named_scope("dense_layers"):
            h, _ = scan_blocks(
                self.dense_layers, emb, c.remat, c.unroll_layers, windows=dense_windows
            )
        main_ids, mtp_ids = (None, None) if replay is None else replay
        with jax.named_scope("moe_layers"):
            h, stats = scan_blocks(
                self.moe_layers,
                h,
                c.remat,
                c.unroll_layers,
                windows=moe_windows,
                return_routing=return_routing,
                replay=main_ids,
            )
        with jax.named_scope("head"):
            h = self.norm(h)
            out = head(h)
        mtp_out, mtp_stats = None, None
        if self.mtp is not None:
            with jax.named_scope("mtp"):
                mtp_out, mtp_stats = self.mtp(
                    h, emb, head, remat=c.remat, return_routing=return_routing, replay=mtp_ids
                )
        empty = None
        if stats is None or mtp_stats is None:
            empty = _empty_stats(c, emb.shape[0] * emb.shape[1], emb.shape[1], return_routing)
        return (
            out,
            mtp_out,
            empty if stats is None else stats,
            empty if mtp_stats is None else mtp_stats,
        )


def recorded_routing(out: ModelOutput | ModelFeatures) -> RoutingReplay:
    """The expert choice of every MoE layer in `out` (a call with `return_routing=True`), in
    the form `DeepSeekV3.__call__(replay=...)` takes."""
    main, mtp = out.moe_stats.expert_ids, out.mtp_moe_stats.expert_ids
    if main is None:
        raise ValueError("recorded_routing: the output holds no routing; call with return_routing")
    return main, (mtp if mtp is not None and mtp.shape[0] else None)


def split_windows(
    config: DeepSeekV3Config,
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """The dense and the MoE layers' attention windows (`layer_windows`), or (None, None)."""
    windows = config.layer_windows()
    if windows is None:
        return None, None
    k = config.first_k_dense_replace
    return windows[:k], windows[k:]


def _empty_stats(config: DeepSeekV3Config, tokens: int, seq: int, return_routing: bool) -> MoEStats:
    """MoEStats with a zero-length leading axis, shaped like a real MoE layer's."""

    def one_layer():
        moe = MoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.routing_spec(),
            n_zero_experts=config.n_zero_experts,
            key=jax.random.key(0),
        )
        x = jnp.zeros((tokens, config.hidden_size))
        return moe(x, seq_len=seq, return_routing=return_routing)[1]

    shapes = jax.eval_shape(one_layer)
    return jax.tree.map(lambda s: jnp.zeros((0, *s.shape), s.dtype), shapes)


def check_tokens(tokens: ArrayLike, config: DeepSeekV3Config) -> None:
    """Raises ValueError unless `tokens` is a [batch seq] integer array of ids in
    [0, vocab_size) with seq <= max_position_embeddings. For concrete (host) batches."""
    t = np.asarray(tokens)
    if t.ndim != 2:
        raise ValueError(f"tokens must be [batch seq], got shape {t.shape}")
    if 0 in t.shape:
        raise ValueError(f"tokens must hold at least one token, got shape {t.shape}")
    if not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {t.dtype}")
    if t.shape[1] > config.max_position_embeddings:
        raise ValueError(
            f"sequence length {t.shape[1]} exceeds max_position_embeddings "
            f"({config.max_position_embeddings})"
        )
    bad = (t < 0) | (t >= config.vocab_size)
    if bad.any():
        b, i = np.argwhere(bad)[0]
        raise ValueError(
            f"token id {int(t[b, i])} at [{b}, {i}] is outside the vocabulary "
            f"[0, {config.vocab_size}) ({int(bad.sum())} such ids in the batch)"
        )
