"""The train state on a device mesh: the mesh of `--mesh` (checked against the run), the model
made ready for it, the shardings of the state's arrays, and a state made or placed on the mesh.

    mesh = resolve_mesh("data=2,expert=4", model_config, train_config)   # None: one device
    # built sharded; the model passes prepare_model (expert-parallel when expert > 1, checked)
    state = init_sharded_state(lambda: DeepSeekV3(model_config, key=key), train_config, mesh)

Every array of the state lives on the mesh: parameters and Adam moments as
`sharding.param_specs` / `opt_state_specs` say, the rest replicated. A fresh state is made
there, each device computing only its shards (`init_sharded_state`); checkpoints save those
arrays as they are, and a resumed run reads each process's shards into the shardings of the
abstract state (`abstract_sharded_state`). The step on the mesh: `dropless.train.step._sharded`.
"""

import math
from collections.abc import Callable

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from dropless import sharding
from dropless._dispatch import AbstractExpertParallelDispatcher, AbstractRowWeightsDispatcher
from dropless._moe import MoE
from dropless.backends import Backend, with_backend
from dropless.backends._ep import ep_backend
from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from dropless.train._config import TrainConfig
from dropless.train.step import _optim as optim
from dropless.train.step._step import TrainState, init_state


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
