"""The train state, and the jitted train and eval steps on one device.

The routers' `expert_bias` (aux-loss-free balancing) is no parameter of the optimiser: it is
partitioned out before the gradient (so it gets neither gradient nor weight decay) and moved
after the optimiser step by its router's rule (`dropless._bias_update`, through
`step_expert_bias`) from the step's tokens-per-expert; a rule with a memory (the PID rule) keeps
it in `TrainState.bias_state`. The loss: `dropless.train.step._loss`.

Loss weights and the schedule live in the state as arrays (`TrainState.hparams`), like the
optimiser's numbers: the compiled step depends only on the model and the batch shape.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PyTree

from dropless._moe import MoE
from dropless._precision import apply_updates
from dropless.models.deepseek_v3 import (
    DeepSeekV3,
    ModelOutput,
    expert_bias_state,
    step_expert_bias,
)
from dropless.train._config import TrainConfig
from dropless.train.step import _optim as optim
from dropless.train.step._accumulate import accumulated
from dropless.train.step._loss import batch_loads, loads_only, stats_metrics, weighted_loss

# TrainConfig fields that the step reads as data (see `hparams`).
HPARAM_FIELDS = (
    "lr",
    "warmup_steps",
    "steps",
    "min_lr_ratio",
    "mtp_loss_weight",
    "balance_loss_coef",
    "seq_balance_loss_coef",
    "global_balance_loss_coef",
    "z_loss_coef",
    "bias_update_rate",
)


class TrainState(eqx.Module):
    """Everything a training run carries from step to step (and checkpoints).

    With `TrainConfig.weight_dtype` below float32, `model` holds its trainable arrays in that
    dtype (what the forward and backward read; the gradients come in it too) and `master` the
    float32 master weights, which the optimiser updates; each step's model weights are the
    master weights rounded. `grad_accum_dtype` is `TrainConfig.grad_accum_dtype`."""

    model: DeepSeekV3
    opt_state: PyTree
    step: Int[Array, ""]  # optimiser steps done
    expert_load: Float[Array, "layers experts"]  # tokens per expert, summed over the run
    hparams: dict[str, Float[Array, ""]]  # HPARAM_FIELDS of the TrainConfig, as arrays
    master: PyTree | None = None  # float32 trainable arrays, when the model's are narrower
    bias_state: PyTree = None  # the bias rules' memory (`expert_bias_state`; None: none)
    grad_accum_dtype: str = eqx.field(default="float32", static=True)


def hparams(config: TrainConfig) -> dict[str, Float[Array, ""]]:
    """The schedule and loss weights of `config`, as float32 scalars."""
    return {name: jnp.asarray(getattr(config, name), jnp.float32) for name in HPARAM_FIELDS}


def moe_layer_names(model: DeepSeekV3) -> list[str]:
    """Names of the rows of the MoE statistics: the main MoE layers (by their index in the whole
    model), then the MTP blocks ("mtp0", ...)."""
    names = []
    if model.moe_layers is not None and isinstance(model.moe_layers.mlp, MoE):
        first = model.config.first_k_dense_replace
        n = model.moe_layers.mlp.router.w_router.shape[0]
        names += [str(first + i) for i in range(n)]
    if model.mtp is not None and isinstance(model.mtp.layers.block.mlp, MoE):
        n = model.mtp.layers.block.mlp.router.w_router.shape[0]
        names += [f"mtp{d}" for d in range(n)]
    return names


def init_state(model: DeepSeekV3, config: TrainConfig) -> TrainState:
    """The state before step 0: the optimiser sees only the trainable arrays (the master
    weights, when `config.weight_dtype` narrows the model's)."""
    params, frozen = eqx.partition(model, optim.trainable_filter(model))
    master = None
    if config.weight_dtype != "float32":
        master = params
        model = eqx.combine(_cast(params, jnp.dtype(config.weight_dtype)), frozen)
    rows = len(moe_layer_names(model))
    return TrainState(
        model=model,
        opt_state=optim.optimizer_state(config, params),
        step=jnp.zeros((), jnp.int32),
        expert_load=jnp.zeros((rows, model.config.n_routed_experts), jnp.float32),
        hparams=hparams(config),
        master=master,
        bias_state=expert_bias_state(model),
        grad_accum_dtype=config.grad_accum_dtype,
    )


def _cast(tree: PyTree, dtype) -> PyTree:
    return jax.tree.map(lambda a: a.astype(dtype), tree)


def _cast_like(tree: PyTree, like: PyTree) -> PyTree:
    return jax.tree.map(lambda a, b: a.astype(b.dtype), tree, like)


def with_config(state: TrainState, config: TrainConfig) -> TrainState:
    """`state` with every number of `config` (schedule, loss weights, optimiser settings)
    installed, keeping the model, moments and counts: how a resumed run adopts its config."""
    return TrainState(
        model=state.model,
        opt_state=optim.with_config(state.opt_state, config),
        step=state.step,
        expert_load=state.expert_load,
        hparams=hparams(config),
        master=state.master,
        bias_state=state.bias_state,
        grad_accum_dtype=config.grad_accum_dtype,
    )


def _learning_rate(state: TrainState) -> Float[Array, ""]:
    h = state.hparams
    return optim.warmup_cosine(
        state.step,
        lr=h["lr"],
        warmup_steps=h["warmup_steps"],
        steps=h["steps"],
        min_lr_ratio=h["min_lr_ratio"],
    )


@eqx.filter_jit(donate="all")
def train_step(
    state: TrainState, tokens: Int[Array, "batch window"], micro_batches: int = 1
) -> tuple[TrainState, dict[str, Array]]:
    """One optimiser step on a batch of windows; `state` is donated (do not reuse it).
    `micro_batches` > 1 computes the gradient in that many passes over equal slices of the
    batch (`dropless.train.step._accumulate`), for batches too large for one pass.

    Metrics are device arrays: scalars (loss, ce, mtp, balance_loss, seq_balance_loss,
    global_balance_loss, z_loss, max_vio, dropped, router_entropy and active_experts (computing
    experts per token; means over MoE layers), unused_experts (experts no token chose in this
    step, over all MoE layers), grad_norm,
    update_norm, param_norm, lr) plus `max_vio_layers [layers]` and
    `tokens_per_expert [layers experts]`.
    """
    params, frozen = eqx.partition(state.model, optim.trainable_filter(state.model))
    loads = None
    if micro_batches > 1:  # the global-batch loss needs the whole batch's loads first
        loads = jax.lax.cond(
            state.hparams["global_balance_loss_coef"] != 0,
            lambda: batch_loads(state.model, tokens, micro_batches),
            lambda: jnp.zeros_like(state.expert_load),
        )

    def loss_fn(params, tokens):
        return weighted_loss(eqx.combine(params, frozen), tokens, state.hparams, loads)

    value_and_grad = accumulated(
        eqx.filter_value_and_grad(loss_fn, has_aux=True),
        micro_batches,
        grad_dtype=state.grad_accum_dtype,
    )
    (loss, (terms, stats)), grads = value_and_grad(params, tokens)
    return apply_gradients(state, grads, loads_only(jax.lax.stop_gradient(stats)), loss, terms)


def apply_gradients(
    state: TrainState,
    grads: PyTree,
    out: ModelOutput,
    loss: Float[Array, ""],
    terms: dict[str, Float[Array, ""]],
) -> tuple[TrainState, dict[str, Array]]:
    """The rest of a step once the gradients are known, shared by the single-device and the
    sharded step: the optimiser update, then (outside the gradient, and not an optimiser
    parameter) the expert-bias update from the loads in `out`, and the step's metrics."""
    params, frozen = eqx.partition(state.model, optim.trainable_filter(state.model))
    weights, master = params, state.master
    if master is not None:  # the optimiser updates the float32 master weights
        params, grads = master, _cast_like(grads, master)
    lr = _learning_rate(state)
    opt_state = optim.with_learning_rate(state.opt_state, lr)
    updates, opt_state = optim.optimizer().update(grads, opt_state, params)
    new_params = apply_updates(params, updates)
    model = eqx.combine(_cast_like(new_params, weights), frozen)
    master = None if master is None else new_params
    # A rate of 0 leaves the bias exactly as it is.
    rate = state.hparams["bias_update_rate"]
    model, bias_state = step_expert_bias(model, out, rate, state.bias_state)
    stats = stats_metrics(out)
    new_state = TrainState(
        model=model,
        opt_state=opt_state,
        step=state.step + 1,
        expert_load=state.expert_load + stats["tokens_per_expert"],
        hparams=state.hparams,
        master=master,
        bias_state=bias_state,
        grad_accum_dtype=state.grad_accum_dtype,
    )
    metrics = {
        "loss": loss,
        **terms,
        **stats,
        "grad_norm": optax.tree.norm(grads),
        "update_norm": optax.tree.norm(updates),
        "param_norm": optax.tree.norm(params),  # before the update: its bound's scale
        "lr": lr,
    }
    return new_state, metrics


@eqx.filter_jit
def eval_step(
    model: DeepSeekV3,
    tokens: Int[Array, "batch window"],
    weights: dict[str, Float[Array, ""]],
    micro_batches: int = 1,
) -> dict[str, Array]:
    """Loss, its terms, max_vio and tokens_per_expert of `model` on a batch, no update; in
    `micro_batches` passes like `train_step`, so that a batch that trains in slices evaluates."""

    def loss_fn(model, tokens):
        return weighted_loss(model, tokens, weights), None  # no gradient

    (loss, (terms, stats)), _ = accumulated(loss_fn, micro_batches)(model, tokens)
    return {"loss": loss, **terms, **stats_metrics(loads_only(stats))}
