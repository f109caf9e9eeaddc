"""Building DeepSeek-V3 decoder blocks from a config, stacking them, and scanning over a stack.

A stack is one `DecoderBlock` whose arrays carry a leading `layers` axis (built with
`eqx.filter_vmap` over keys); `scan_blocks` runs it with `jax.lax.scan`, so a 61-layer model
compiles one dense block and one MoE block, or, with `unroll`, every layer inline
(`dropless.nn.unrolled_scan`).

Inside `gathering_layers(gather)` every loop body over a stack (here and in `MTP`) first
passes its layer's arrays through `gather` (`whole_layer`): how a sharded step all-gathers one
layer's FSDP-sharded weights at a time, inside the loop.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from dropless._moe import MoE, MoEStats
from dropless._precision import cast_for_compute
from dropless._swiglu import SwiGLU
from dropless.backends import Backend
from dropless.models.deepseek_v3._block import DecoderBlock
from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.nn._attention import GQA
from dropless.nn._mla import ATTENTIONS, MLA
from dropless.nn._unroll import unrolled_scan

REMAT: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# The blocks' matmul weights (the attention's projections, the SwiGLU and expert weights): each
# is cast to the compute dtype where it is used, and used once per layer. The router's weight
# and the norms' are used in float32 and are not listed.
MATMUL_WEIGHTS = frozenset(
    {"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    | {"k_proj", "v_proj"}
    | {"w_gate", "w_up", "w_down", "eh_proj"}
)

_LAYER_GATHER: contextvars.ContextVar[Callable[[PyTree], PyTree] | None] = contextvars.ContextVar(
    "dropless_layer_gather", default=None
)


@contextlib.contextmanager
def gathering_layers(gather: Callable[[PyTree], PyTree]) -> Iterator[None]:
    """While tracing inside this block, the arrays of each layer of every scanned stack pass
    through `gather` at the top of the loop body (see `whole_layer`). A sharded step passes
    a function that all-gathers the layer's FSDP-sharded arrays: one layer's weights are then
    whole at a time, and the gathers' transposes (reduce-scatters) run in the backward loop."""
    token = _LAYER_GATHER.set(gather)
    try:
        yield
    finally:
        _LAYER_GATHER.reset(token)


def whole_layer(layer_arrays: PyTree, dtype) -> PyTree:
    """Inside a loop body over a stack: the layer's arrays as the layer uses them. Outside
    `gathering_layers`, `layer_arrays` itself. Inside, its matmul weights are cast to the
    compute `dtype` first (their gathers then move that dtype: bf16 halves the bytes), and the
    gather runs under `jax.checkpoint`, so the backward gathers again instead of keeping every
    layer's whole weights (with or without the model's remat)."""
    gather = _LAYER_GATHER.get()
    if gather is None:
        return layer_arrays

    def cast_then_gather(arrays):
        return gather(_cast_matmul_weights(arrays, dtype))

    policy = jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint(cast_then_gather, policy=policy)(layer_arrays)


def is_matmul_weight(path, leaf) -> bool:
    """Whether `leaf`, at `path` in a layer's tree, is one of its floating-point
    `MATMUL_WEIGHTS`: the arrays cast to the compute dtype before use (and gathered in it)."""
    name = path[-1].name if path and isinstance(path[-1], jax.tree_util.GetAttrKey) else None
    return name in MATMUL_WEIGHTS and eqx.is_inexact_array(leaf)


def _cast_matmul_weights(arrays: PyTree, dtype) -> PyTree:
    def cast(path, leaf):
        return leaf.astype(dtype) if is_matmul_weight(path, leaf) else leaf

    return jax.tree_util.tree_map_with_path(cast, arrays)


def moe_strategies(backend: Backend | None) -> dict[str, Any]:
    """The `MoE` strategy arguments (`dispatcher`, `gmm`, `topk`) that `backend` sets: its
    fields that are not None; None sets none (MoE's defaults). Raises TypeError for anything
    else: names are resolved where a program starts, with
    `dropless.train.get_backend(name)`."""
    if backend is None:
        return {}
    if not isinstance(backend, Backend):
        hint = ""
        if isinstance(backend, str):
            hint = f"; for a backend's name, pass dropless.train.get_backend({backend!r})"
        raise TypeError(f"backend must be a dropless.Backend or None, got {backend!r}{hint}")
    fields = {"dispatcher": backend.dispatcher, "gmm": backend.gmm, "topk": backend.topk}
    return {name: value for name, value in fields.items() if value is not None}


def make_attention(config: DeepSeekV3Config, *, key: PRNGKeyArray) -> MLA | GQA:
    """The attention `config.attention_type` names: MLA, or grouped-query attention."""
    c, dt = config, config.param_jnp_dtype
    rope = dict(
        rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling,
        max_position_embeddings=c.max_position_embeddings,
        rope_interleave=c.rope_interleave,
    )
    if c.attention_type == "gqa":
        return GQA(
            c.hidden_size,
            c.num_attention_heads,
            c.kv_heads,
            c.gqa_head_dim,
            qk_norm=c.qk_norm,
            window=c.sliding_window,
            bias=c.attention_bias,
            sinks=c.attention_sinks,
            eps=c.rms_norm_eps,
            impl=c.attention_impl,
            dtype=dt,
            key=key,
            **rope,
        )
    return MLA(
        c.hidden_size,
        c.num_attention_heads,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        # the latent norms keep MLA's own 1e-6 whatever rms_norm_eps says, as DeepSeek's and
        # transformers' code do
        attention=ATTENTIONS[c.attention_impl](),
        dtype=dt,
        key=key,
        **rope,
    )


def make_block(
    config: DeepSeekV3Config, *, moe: bool, backend: Backend | None = None, key: PRNGKeyArray
) -> DecoderBlock:
    """One decoder block: attention (`make_attention`), then a dense SwiGLU
    (`intermediate_size`) or the MoE layer (with `backend`'s strategies, see
    `moe_strategies`)."""
    c, dt = config, config.param_jnp_dtype
    k_attn, k_mlp = jax.random.split(key)
    attn = make_attention(c, key=k_attn)
    if moe:
        mlp = MoE(
            c.hidden_size,
            c.moe_intermediate_size,
            c.routing_spec(),
            n_shared_experts=c.n_shared_experts,
            dtype=dt,
            weights_before_down=c.moe_weights_before_down,
            bias_update=c.bias_update_rule(),
            n_zero_experts=c.n_zero_experts,
            zero_output=c.zero_expert_output,
            active_experts=c.zero_expert_active,
            experts_bias=c.experts_bias,
            swiglu_limit=c.swiglu_limit,
            swiglu_alpha=c.swiglu_alpha,
            key=k_mlp,
            **moe_strategies(backend),
        )
    else:
        mlp = SwiGLU(c.hidden_size, c.intermediate_size, dtype=dt, key=k_mlp)
    return DecoderBlock(attn, mlp, c.hidden_size, eps=c.rms_norm_eps, dtype=dt)


def stack_blocks(
    config: DeepSeekV3Config,
    n: int,
    *,
    moe: bool,
    backend: Backend | None = None,
    key: PRNGKeyArray,
) -> DecoderBlock | None:
    """`n` blocks as one stacked block (leading `layers` axis on every array); None if n == 0."""
    moe_strategies(backend)  # a wrong backend fails here, whatever n
    if n == 0:
        return None

    def make(k):
        return make_block(config, moe=moe, backend=backend, key=k)

    return eqx.filter_vmap(make)(jax.random.split(key, n))


def unstack(stack: eqx.Module, i: int) -> eqx.Module:
    """Layer `i` of a stacked module (arrays indexed, everything else shared)."""
    return jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, stack)


def scan_blocks(
    stack: DecoderBlock | None,
    x: Float[Array, "batch seq dim"],
    remat: str = "none",
    unroll: bool = False,
    *,
    windows: Sequence[int] | None = None,
    return_routing: bool = False,
    replay: Int[Array, "layers tokens k"] | None = None,
) -> tuple[Float[Array, "batch seq dim"], MoEStats | None]:
    """Applies the stacked blocks in order; MoE stats come back with a leading `layers` axis
    (with each layer's routing under `return_routing`; `replay` gives each MoE layer the
    expert choice recorded so). `windows`: each layer's attention window
    (`DeepSeekV3Config.layer_windows`), scanned with the layers; None: their own.
    `unroll` emits every layer inline instead of a loop (`unrolled_scan`): per-layer residuals
    are then separate buffers rather than slices written into and read from stacks. The
    stacked matmul weights pass `matmul_weights_cast` first (see the comment below)."""
    if stack is None:
        return x, None
    arrays, static = eqx.partition(stack, eqx.is_array)
    # Each stacked matmul weight passes `cast_for_compute`, so its gradient leaves the layers
    # as one materialised buffer, not stacked inside every optimiser reader by a fusion.
    # Without remat, a gradient's backward keeps the layers' compute-dtype weights anyway, so
    # the cast moves up front here at no extra memory (a forward alone, as in evaluation,
    # holds one compute-dtype copy of the stacks) and the gradients stack in that dtype;
    # under remat the per-layer cast is recomputed instead of holding a copy of every stack,
    # and the stacks keep their own dtype.
    arrays = matmul_weights_cast(arrays, x.dtype if REMAT[remat] is None else None)

    def body(h, xs):
        layer_arrays, window, ids = xs
        block = eqx.combine(whole_layer(layer_arrays, h.dtype), static)
        return block(h, window=window, return_routing=return_routing, replay=ids)

    if REMAT[remat] is not None:
        # prevent_cse=False is safe (and faster) inside scan, which already blocks CSE.
        # Unrolled, the layers are straight-line code: without it XLA could merge the
        # recomputation with the forward, and remat would save nothing.
        body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=unroll)
    xs = (arrays, None if windows is None else jnp.asarray(windows, jnp.int32), replay)
    if unroll:
        return unrolled_scan(body, x, xs)
    return jax.lax.scan(body, x, xs)


def matmul_weights_cast(arrays: eqx.Module, dtype=None) -> eqx.Module:
    """The stacked `MATMUL_WEIGHTS` of `arrays` through `cast_for_compute` to `dtype` (None:
    their own), so that the blocks' own casts are no-ops. Other arrays are returned as they
    are."""

    def cast(path, leaf):
        if is_matmul_weight(path, leaf):
            return cast_for_compute(leaf, leaf.dtype if dtype is None else dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(cast, arrays)
