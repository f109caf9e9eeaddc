"""The train and eval steps on a device mesh (`TrainConfig.mesh`, `--mesh data=2,expert=4`).

    mesh = resolve_mesh("data=2,expert=4", model_config, train_config)   # sharded_state
    state = init_sharded_state(lambda: DeepSeekV3(model_config, key=key), train_config, mesh)
    state, metrics = sharded_train_step(mesh, state, sharding.shard_batch(tokens, mesh))

The step is `dropless.train.step.train_step` run through `sharded_value_and_grad`: each
device computes the loss of its slice of the batch; the loss terms are averaged over slices, the
MoE statistics summed (tokens per expert and drops are those of the whole batch, MaxVio is
recomputed from them), and the aux-loss-free expert-bias update sees the GLOBAL tokens per
expert, so the step equals the single-device one. Exception: the batch-wise balance loss
(`balance_loss_coef`) becomes the mean of per-device losses (see docs/distributed.md).

The state lives on the mesh as `dropless.train.step._sharded_state` places it.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from dropless import sharding
from dropless._moe import MoEStats, with_loads
from dropless.models.deepseek_v3 import DeepSeekV3
from dropless.models.deepseek_v3._layers import gathering_layers
from dropless.train.step import _optim as optim
from dropless.train.step._accumulate import accumulated
from dropless.train.step._loss import loads_only, stats_metrics, weighted_loss
from dropless.train.step._sharded_grad import layer_gathering, sharded_value_and_grad
from dropless.train.step._sharded_state import state_shardings
from dropless.train.step._step import TrainState, apply_gradients


def _constrain(state: TrainState, mesh: Mesh) -> TrainState:
    arrays, static = eqx.partition(state, eqx.is_array)
    arrays = jax.lax.with_sharding_constraint(arrays, state_shardings(arrays, mesh))
    return eqx.combine(arrays, static)


def _global_stats(stats: MoEStats, axes: tuple[str, ...]) -> MoEStats:
    """Inside shard_map: stacked per-layer MoE statistics of this shard -> tokens per expert and
    drops of the whole batch (MaxVio recomputed per layer from them); losses stay per shard (the
    caller averages them)."""
    counts, dropped = stats.tokens_per_expert, stats.dropped
    if not axes:
        return stats
    stats = eqx.tree_at(lambda s: s.zero_tokens, stats, jax.lax.psum(stats.zero_tokens, axes))
    return with_loads(stats, jax.lax.psum(counts, axes), jax.lax.psum(dropped, axes))


def _local_loss(mesh: Mesh, loads: Array | None = None):
    """`loss_fn((model, weights), tokens)` for `sharded_value_and_grad`: the weighted
    loss of this shard, and (terms, global main-stack stats, global MTP stats) as aux. The
    global-batch balance loss reads `loads` (the whole batch's), or the shards' loads summed."""
    axes = sharding.batch_axes(mesh)

    def gather(counts):
        return jax.lax.psum(counts, axes) if axes else counts

    def loss_fn(model_and_weights, tokens):
        model, weights = model_and_weights
        loss, (terms, stats) = weighted_loss(model, tokens, weights, loads, gather=gather)
        return loss, (terms, tuple(_global_stats(s, axes) for s in stats))

    return loss_fn


@eqx.filter_jit(donate="all-except-first")
def sharded_train_step(
    mesh: Mesh, state: TrainState, tokens: Int[Array, "batch window"], micro_batches: int = 1
) -> tuple[TrainState, dict[str, Array]]:
    """`dropless.train.step.train_step` on `mesh` (same metrics and `micro_batches`); `state`
    must be placed by `shard_state`, `tokens` by `sharding.shard_batch`. `state` is donated."""
    trainable = optim.trainable_filter(state.model)
    frozen_weights = jax.tree.map(lambda _: False, state.hparams)
    loads = None
    if micro_batches > 1:  # the global-batch loss needs the whole batch's loads first
        loads = jax.lax.cond(
            state.hparams["global_balance_loss_coef"] != 0,
            lambda: sharded_eval_step(mesh, state.model, tokens, state.hparams, micro_batches)[
                "tokens_per_expert"
            ],
            lambda: jnp.zeros_like(state.expert_load),
        )
    value_and_grad = sharded_value_and_grad(
        _local_loss(mesh, loads), mesh, has_aux=True, diff_filter=(trainable, frozen_weights)
    )
    value_and_grad = accumulated(value_and_grad, micro_batches, grad_dtype=state.grad_accum_dtype)
    (loss, (terms, stats)), (grads, _) = value_and_grad((state.model, state.hparams), tokens)
    loads = loads_only(jax.lax.stop_gradient(stats))
    new_state, metrics = apply_gradients(state, grads, loads, loss, terms)
    return _constrain(new_state, mesh), metrics


@eqx.filter_jit
def sharded_eval_step(
    mesh: Mesh,
    model: DeepSeekV3,
    tokens: Int[Array, "batch window"],
    weights: dict[str, Array],
    micro_batches: int = 1,
) -> dict[str, Array]:
    """`dropless.train.step.eval_step` on `mesh` (`tokens` split over the batch axes), each
    device's share in `micro_batches` passes."""
    axes = sharding.batch_axes(mesh)
    arrays, static = eqx.partition(model, eqx.is_array)
    specs = sharding.param_specs(arrays, mesh)
    top_gathers, gather_layer = layer_gathering(sharding.fsdp_specs(arrays, mesh))
    loss_fn = _local_loss(mesh)

    def without_gradient(model_and_weights, tokens):
        return loss_fn(model_and_weights, tokens), None

    def local(arrays, weights, tokens):
        model = eqx.combine(sharding.gather_fsdp(arrays, top_gathers), static)
        run = accumulated(without_gradient, micro_batches)
        with gathering_layers(gather_layer):
            (loss, (terms, stats)), _ = run((model, weights), tokens)
        out = {"loss": loss, **terms}
        if axes:
            out = jax.tree.map(lambda a: jax.lax.pmean(a, axes), out)
        return {**out, **stats_metrics(loads_only(stats))}

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(specs, P(), sharding.batch_spec(mesh)),
        out_specs=P(),
        check_vma=False,
    )(arrays, weights, tokens)
