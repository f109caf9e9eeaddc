"""The train loop's state and steps on a device mesh (`TrainConfig.mesh`, `--mesh data=2,expert=4`).

    mesh = resolve_mesh("data=2,expert=4", model_config, train_config)   # None: one device
    # built sharded; the model passes prepare_model (expert-parallel when expert > 1, checked)
    state = init_sharded_state(lambda: DeepSeekV3(model_config, key=key), train_config, mesh)
    state, metrics = sharded_train_step(mesh, state, sharding.shard_batch(tokens, mesh))

The step is `dropless.train.step.step.train_step` run through `sharded_value_and_grad`: each
device computes the loss of its slice of the batch; the loss terms are averaged over slices, the
MoE statistics summed (tokens per expert and drops are those of the whole batch, MaxVio is
recomputed from them), and the aux-loss-free expert-bias update sees the GLOBAL tokens per
expert, so the step equals the single-device one. Exception: the batch-wise balance loss
(`balance_loss_coef`) becomes the mean of per-device losses (see docs/distributed.md).

Every array of the state lives on the mesh: parameters and Adam moments as
`sharding.param_specs` / `opt_state_specs` say, the rest replicated. A fresh state is made
there, each device computing only its shards (`init_sharded_state`); checkpoints save those
arrays as they are, and a resumed run reads each process's shards into the shardings of the
abstract state (`abstract_sharded_state`).
"""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int, PyTree

from dropless import sharding
from dropless.backends import Backend, with_backend
from dropless.backends.ep import ep_backend
from dropless.dispatch import AbstractExpertParallelDispatcher, AbstractRowWeightsDispatcher
from dropless.models.deepseek_v3 import (
    DeepSeekV3,
    DeepSeekV3Config,
)
from dropless.models.deepseek_v3.block import DecoderBlock
from dropless.models.deepseek_v3.layers import gathering_layers
from dropless.models.deepseek_v3.mtp import MTPModule
from dropless.moe import MoE, MoEStats, with_loads
from dropless.train.config import TrainConfig
from dropless.train.step import optim
from dropless.train.step.accumulate import accumulated
from dropless.train.step.step import (
    TrainState,
    apply_gradients,
    init_state,
    loads_only,
    stats_metrics,
    weighted_loss,
)


def resolve_mesh(
    spec: str | None, model_config: DeepSeekV3Config, train_config: TrainConfig
) -> Mesh | None:
    """The mesh of a `--mesh` string, after checking the run fits on it; None when no mesh is
    asked for or it has a single device (the run then takes the single-device path).

    Raises ValueError naming the setting at fault: a malformed spec or one whose product is not
    the device count (`mesh`), a batch (or micro-batch) the batch shards do not divide
    (`batch_size`, `micro_batches`), experts the expert axis does not divide
    (`n_routed_experts`).
    """
    if spec is None:
        return None
    try:
        mesh = sharding.mesh_from_spec(spec)
    except ValueError as err:
        raise ValueError(f"TrainConfig.mesh = {spec!r}: {err}") from None
    if mesh.size == 1:
        return None
    axes = sharding.batch_axes(mesh)
    shards = math.prod(mesh.shape[a] for a in axes)
    slice_size = train_config.batch_size // train_config.micro_batches
    if slice_size % shards:
        layout = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
        per_slice = (
            f" / micro_batches ({train_config.micro_batches})"
            if train_config.micro_batches > 1
            else ""
        )
        raise ValueError(
            f"TrainConfig.batch_size ({train_config.batch_size}){per_slice} must be divisible by "
            f"the number of batch shards of mesh {spec!r} ({shards}: {layout})"
        )
    ep = mesh.shape["expert"]
    if ep > 1 and model_config.n_routed_experts % ep:
        raise ValueError(
            f"DeepSeekV3Config.n_routed_experts ({model_config.n_routed_experts}) must be "
            f"divisible by the expert axis of mesh {spec!r} (expert={ep})"
        )
    return mesh


def prepare_model(model: DeepSeekV3, mesh: Mesh) -> DeepSeekV3:
    """`model` ready for `mesh`, checked by `sharding.check_expert_parallel` (not yet placed:
    see `shard_state`). When the expert axis is > 1, a model whose dispatchers cannot move
    tokens between devices gets the "ep" backend's dispatcher and keeps its other stages (its
    grouped matmul and top-k); an expert-parallel dispatcher (`nccl_ep`, an
    `ep_backend(recv_factor=...)`) stays as it is. Raises ValueError when an MoE layer cannot
    run with that dispatcher (`weights_before_down` needs row weights it does not give)."""
    exchanging = all(
        isinstance(d, AbstractExpertParallelDispatcher) for d in sharding.dispatchers(model)
    )
    if mesh.shape["expert"] > 1 and not exchanging:
        dispatcher = ep_backend().dispatcher
        for moe in _moe_layers(model):
            if moe.weights_before_down and not isinstance(dispatcher, AbstractRowWeightsDispatcher):
                raise ValueError(
                    f"DeepSeekV3Config.moe_weights_before_down needs a dispatcher with row "
                    f"weights, and expert parallelism (expert={mesh.shape['expert']}) runs "
                    f"{type(dispatcher).__name__}, which has none: set it to false"
                )
        model = with_backend(model, Backend(dispatcher=dispatcher))
    sharding.check_expert_parallel(model, mesh)
    return model


def _moe_layers(model) -> list[MoE]:
    nodes = jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, MoE))
    return [n for n in nodes if isinstance(n, MoE)]


def stages(model) -> dict[str, str]:
    """What runs in `model`'s MoE layers: the class name of each stage (dispatcher, gmm,
    topk), as config.yaml records it; empty without MoE layers."""
    layers = _moe_layers(model)
    if not layers:
        return {}
    moe = layers[0]
    return {
        "dispatcher": type(moe.dispatcher).__name__,
        "gmm": type(moe.experts.gmm).__name__,
        "topk": type(moe.router.topk).__name__,
    }


def state_shardings(state: TrainState, mesh: Mesh) -> PyTree:
    """A `NamedSharding` for every array of `state` (None elsewhere): the model's arrays per
    `sharding.param_specs`, the optimiser's moments like their parameters, the rest replicated.
    `state` may be abstract (`jax.ShapeDtypeStruct` leaves, from `eqx.filter_eval_shape`)."""
    model_arrays = eqx.filter(state.model, sharding.is_array_like)
    model_specs = sharding.param_specs(model_arrays, mesh)
    params = eqx.filter(state.model, optim.trainable_filter(state.model))
    param_specs = sharding.param_specs(params, mesh)
    opt_specs = sharding.opt_state_specs(state.opt_state, params, param_specs)
    master_specs = sharding.param_specs(state.master, mesh) if state.master is not None else None
    hparams = {name: P() for name in state.hparams}
    bias_state = jax.tree.map(lambda _: P(), state.bias_state)
    parts = (model_specs, opt_specs, P(), P(), hparams, master_specs, bias_state)
    leaves = [NamedSharding(mesh, spec) for part in parts for spec in jax.tree.leaves(part)]
    # unflatten, not TrainState(...): the fields hold shardings, not arrays
    return jax.tree.unflatten(jax.tree.structure(eqx.filter(state, sharding.is_array_like)), leaves)


def shard_state(state: TrainState, mesh: Mesh) -> TrainState:
    """`state` with every array placed on `mesh` (`state_shardings`)."""
    arrays, static = eqx.partition(state, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, state_shardings(arrays, mesh)), static)


def abstract_sharded_state(
    make_model: Callable[[], DeepSeekV3], train_config: TrainConfig, mesh: Mesh
) -> TrainState:
    """The state `init_sharded_state` makes, as `jax.ShapeDtypeStruct`s carrying their
    shardings: nothing allocated (what a resumed run restores into)."""
    abstract = eqx.filter_eval_shape(
        lambda: init_state(prepare_model(make_model(), mesh), train_config)
    )
    arrays, static = eqx.partition(abstract, sharding.is_array_like)
    placed = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        arrays,
        state_shardings(arrays, mesh),
    )
    return eqx.combine(placed, static)


def init_sharded_state(
    make_model: Callable[[], DeepSeekV3], train_config: TrainConfig, mesh: Mesh
) -> TrainState:
    """`shard_state(init_state(prepare_model(make_model(), mesh), train_config), mesh)`, made
    without the whole state on any device: the model is built and the optimiser initialised
    under `jax.jit` whose outputs are sharded as `state_shardings` says, so each device
    computes and holds only its shards (at 671B the whole float32 model is 2.7 TB)."""
    arrays, static = eqx.partition(
        abstract_sharded_state(make_model, train_config, mesh), sharding.is_array_like
    )

    def build():
        state = init_state(prepare_model(make_model(), mesh), train_config)
        return eqx.filter(state, eqx.is_array)

    out_shardings = jax.tree.map(lambda a: a.sharding, arrays)
    return eqx.combine(jax.jit(build, out_shardings=out_shardings)(), static)


def _sum_unsharded(grads: PyTree, specs: PyTree, mesh: Mesh) -> PyTree:
    """Inside shard_map (check_vma=False): each gradient is the local contribution; sum it over
    the mesh axes along which its parameter is replicated (fsdp was reduce-scattered already)."""

    def reduce(g, spec):
        if g is None or spec is None:
            return g
        used = set()
        for entry in spec:
            used.update((entry,) if isinstance(entry, str) else tuple(entry or ()))
        axes = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
        return jax.lax.psum(g, axes) if axes else g

    return jax.tree.map(reduce, grads, specs, is_leaf=lambda n: n is None)


def _is_stack(node) -> bool:
    return isinstance(node, (DecoderBlock, MTPModule))


def _per_layer_spec(spec: P | None) -> P | None:
    if spec is None:
        return None
    if spec and spec[0] is not None:
        raise ValueError(
            f"a layer stack's array is sharded over its layer axis ({spec}); the layers are "
            "gathered one at a time, so raise fsdp_min_size or give the layers another shape"
        )
    return P(*spec[1:])


def layer_gathering(specs: PyTree) -> tuple[PyTree, Callable[[PyTree], PyTree]]:
    """How a model's FSDP-sharded arrays become whole inside `jax.shard_map`, one layer at a
    time: (the specs of what `sharding.gather_fsdp` gathers before the model runs: every array
    outside the scanned layer stacks; the per-layer gather for `gathering_layers`, which finds
    a layer's specs by its tree structure). `specs` is `sharding.fsdp_specs` of the model."""
    per_layer: dict[Any, PyTree] = {}
    for stack in jax.tree.leaves(specs, is_leaf=_is_stack):
        if not _is_stack(stack):
            continue
        layer = jax.tree.map(_per_layer_spec, stack)
        key = jax.tree.structure(stack)
        if key in per_layer and jax.tree.leaves(per_layer[key]) != jax.tree.leaves(layer):
            raise ValueError("two layer stacks of one structure are sharded differently")
        per_layer[key] = layer
    top = jax.tree.map(
        lambda n: jax.tree.map(lambda _: None, n) if _is_stack(n) else n,
        specs,
        is_leaf=lambda n: n is None or _is_stack(n),
    )

    def gather(layer_arrays):
        return sharding.gather_fsdp(layer_arrays, per_layer[jax.tree.structure(layer_arrays)])

    return top, gather


def sharded_value_and_grad(
    loss_fn: Callable[[PyTree, PyTree], Any],
    mesh: Mesh,
    *,
    has_aux: bool = False,
    diff_filter: Callable[[Any], bool] | PyTree = eqx.is_inexact_array,
    fsdp_min_size: int = sharding.FSDP_MIN_SIZE,
) -> Callable[[PyTree, PyTree], tuple[Any, PyTree]]:
    """`eqx.filter_value_and_grad(loss_fn, has_aux)` run SPMD over `mesh`.

    `loss_fn(model, batch)` runs on each device with its batch slice (leading dimension split
    over `sharding.batch_axes`) and must return the mean over that slice (plus `aux` if
    `has_aux`). The returned function takes global `(model, batch)` and gives `(loss, grads)` or
    `((loss, aux), grads)`: the loss of the whole batch (mean over shards), `aux` averaged over
    shards, and the gradient of the whole-batch loss with respect to the arrays `diff_filter`
    selects (a callable on leaves, or a tree of bools like `optim.trainable_filter` returns), as
    global arrays sharded like the parameters. Raises if the model cannot run on `mesh`
    (`sharding.check_expert_parallel`).

    FSDP-sharded arrays are all-gathered where they are used: those of the scanned layer stacks
    (`DecoderBlock`, `MTPModule`) one layer at a time inside the loop, in the compute dtype, and
    gathered again in the backward loop (`layer_gathering`); the rest before `loss_fn` runs.
    Their gradients are reduce-scattered by the gathers' transposes.
    """
    axes = sharding.batch_axes(mesh)
    shards = math.prod(mesh.shape[a] for a in axes)

    def fn(model, batch):
        sharding.check_expert_parallel(model, mesh)
        diff, rest = eqx.partition(model, diff_filter)
        rest, static = eqx.partition(rest, eqx.is_array)
        diff_specs = sharding.param_specs(diff, mesh, fsdp_min_size=fsdp_min_size)
        rest_specs = sharding.param_specs(rest, mesh, fsdp_min_size=fsdp_min_size)
        diff_gathers = sharding.fsdp_specs(diff, mesh, fsdp_min_size=fsdp_min_size)
        rest_gathers = sharding.fsdp_specs(rest, mesh, fsdp_min_size=fsdp_min_size)
        top_gathers, gather_layer = layer_gathering(eqx.combine(diff_gathers, rest_gathers))
        top_diff = _like(diff_gathers, top_gathers)
        top_rest = _like(rest_gathers, top_gathers)

        def local(diff, rest, batch):
            def scaled(diff):
                model = eqx.combine(
                    sharding.gather_fsdp(diff, top_diff),
                    sharding.gather_fsdp(rest, top_rest),
                    static,
                )
                with gathering_layers(gather_layer):
                    out = loss_fn(model, batch)
                loss, aux = out if has_aux else (out, None)
                return loss / shards, (loss, aux)

            (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(diff)
            grads = _sum_unsharded(grads, diff_specs, mesh)
            if axes:
                loss = jax.lax.pmean(loss, axes)
                aux = jax.tree.map(lambda a: jax.lax.pmean(a, axes), aux)
            return loss, aux, grads

        loss, aux, grads = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(diff_specs, rest_specs, sharding.batch_spec(mesh)),
            out_specs=(P(), P(), diff_specs),
            check_vma=False,
        )(diff, rest, batch)
        return ((loss, aux) if has_aux else loss), grads

    return fn


def _like(part: PyTree, top: PyTree) -> PyTree:
    """`top`'s specs where `part` has one (None elsewhere)."""
    return jax.tree.map(
        lambda p, t: None if p is None else t, part, top, is_leaf=lambda n: n is None
    )


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
    """`dropless.train.step.step.train_step` on `mesh` (same metrics and `micro_batches`); `state`
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
    """`dropless.train.step.step.eval_step` on `mesh` (`tokens` split over the batch axes), each
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
