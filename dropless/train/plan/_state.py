"""The training state's bytes on one device for `dropless.train.plan.plan`: every model and
optimiser-state array's shape, dtype and mesh spec (from `eqx.filter_eval_shape`, nothing
allocated), each divided over the mesh as `dropless.sharding` places it (a dimension its mesh
axes do not divide stays whole); the parameters, gradients and moments that follow, and FSDP's
gathered copies under per-layer or step-wide gathers."""

import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from dropless import sharding
from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from dropless.models.deepseek_v3._layers import is_matmul_weight
from dropless.train._config import TrainConfig
from dropless.train.step import _optim as optim
from dropless.train.step._step import HPARAM_FIELDS

# The arrays that a scan over layers (or MTP modules) holds stacked, leading axis first.
_STACKS = ("dense_layers", "moe_layers", "mtp")


def _is_spec(node) -> bool:
    return isinstance(node, jax.sharding.PartitionSpec)


def _spec_leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=_is_spec)


def _mesh_spec(logical, shape, sizes: dict[str, int]) -> jax.sharding.PartitionSpec:
    """`sharding.to_mesh_spec` on axis sizes alone (there is no device `Mesh` to plan on)."""
    return sharding.to_mesh_spec(logical, shape, sizes)


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one entry of a mesh spec."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _local(shape, spec, sizes: dict[str, int]) -> int:
    """Elements of one device's shard of an array of `shape` with mesh spec `spec`."""
    n = math.prod(shape)
    for entry in spec:
        for axis in _axes(entry):
            n //= sizes[axis]
    return n


def arrays(config: DeepSeekV3Config, train: TrainConfig, full: dict[str, int]) -> tuple[list, list]:
    """(shape, dtype, mesh spec, trainable, stack, gathered dtype) of every model array, and
    (shape, dtype, mesh spec) of every optimiser-state array: plain data, so
    `eqx.filter_eval_shape` of this function hands it back without allocating anything.
    `stack` names the layer stack that holds the array (None outside them); a stack's matmul
    weights are gathered in the compute dtype (`layers.whole_layer`), everything else in its
    own."""
    model = DeepSeekV3(config, key=jax.random.key(0))
    mask = optim.trainable_filter(model)
    params = eqx.filter(model, mask)
    specs = jax.tree.map(
        lambda a, s: None if s is None else _mesh_spec(s, a.shape, full),
        model,
        sharding.logical_param_specs(model),
        is_leaf=lambda n: n is None,
    )
    info = []

    def note(path, a, spec, trainable):
        if eqx.is_array(a):
            names = [getattr(k, "name", None) for k in path]
            stack = next((n for n in names if n in _STACKS), None)
            cast = stack is not None and is_matmul_weight(path, a)
            gathered = config.compute_jnp_dtype if cast else a.dtype
            info.append((a.shape, a.dtype, spec, trainable, stack, gathered))

    jax.tree_util.tree_map_with_path(note, model, specs, mask, is_leaf=lambda n: n is None)
    opt = optim.optimizer_state(train, params)
    opt_specs = sharding.opt_state_specs(opt, params, eqx.filter(specs, mask, is_leaf=_is_spec))
    opt_info = [
        (a.shape, a.dtype, s)
        for a, s in zip(jax.tree.leaves(opt), _spec_leaves(opt_specs), strict=True)
    ]
    return info, opt_info


class ParamTerms(NamedTuple):
    """One device's bytes of the model's arrays, by `param_terms`."""

    stored: list[tuple]  # (dtype, bytes of the local shard) of every array
    grads: list[tuple]  # (dtype, bytes of the local shard) of every trainable array
    unsharded: list[tuple]  # (local elements, elements fsdp-gathered, itemsize), trainable
    whole: int  # trainable arrays outside the layer stacks, fsdp-gathered
    per_layer: int  # one layer of the largest trainable stack, fsdp-gathered as it is gathered
    all_reduce: int  # sent by one micro-batch's all-reduces over replicated axes
    stack_copies: int  # layer stacks whose fsdp dimension is not a layer's first


def param_terms(info: list, full: dict[str, int]) -> ParamTerms:
    stored, unsharded, grads = [], [], []
    whole, all_reduce, stack_copies = 0, 0, 0
    layer: dict[str, int] = {}  # stack -> one layer's arrays, gathered
    for shape, dtype, spec, trainable, stack, gathered in info:
        size = jnp.dtype(dtype).itemsize
        local = _local(shape, spec, full)
        stored.append((dtype, local * size))
        if trainable:
            no_fsdp = _local(shape, [e if e != "fsdp" else None for e in spec], full)
            grads.append((dtype, local * size))
            unsharded.append((local, no_fsdp, size))
            if stack:  # one layer's slice: a layer's arrays are gathered together
                gathered_size = jnp.dtype(gathered).itemsize
                layer[stack] = layer.get(stack, 0) + no_fsdp * gathered_size // shape[0]
                if full["fsdp"] > 1 and any("fsdp" in _axes(e) for e in spec[2:]):
                    stack_copies += local * size
            else:
                whole += no_fsdp * size
            used = {a for entry in spec for a in _axes(entry)}
            replicas = math.prod(n for a, n in full.items() if a not in used)
            all_reduce += 2 * (replicas - 1) * local * size // replicas
    per_layer = max(layer.values(), default=0)
    return ParamTerms(stored, grads, unsharded, whole, per_layer, all_reduce, stack_copies)


def moe_layers(config: DeepSeekV3Config) -> int:
    """MoE layers of the model, the MTP modules' included when the model has MoE layers."""
    return config.n_moe_layers + (config.num_nextn_predict_layers if config.n_moe_layers else 0)


def optimizer_terms(
    opt_info: list, full: dict[str, int], config: DeepSeekV3Config
) -> tuple[list[tuple], int]:
    """(dtype, bytes) of the moments' local shards, and the bytes of the other state."""
    moments, other = [], 0
    for shape, dtype, spec in opt_info:
        size = jnp.dtype(dtype).itemsize
        if len(shape):
            moments.append((dtype, _local(shape, spec, full) * size))
        else:
            other += size
    other += moe_layers(config) * config.n_routed_experts * 4  # TrainState.expert_load
    other += 4 * len(HPARAM_FIELDS)  # TrainState.hparams, float32 scalars
    return moments, other


def fsdp_terms(params: ParamTerms, full: dict[str, int], fsdp_gather: str) -> tuple[int, int]:
    """FSDP's gathered parameters and the gradients beyond the device's shard."""
    if full["fsdp"] == 1:
        return 0, 0
    gathered = sum(n * b for _, n, b in params.unsharded)
    grads_extra = sum((n - s) * b for s, n, b in params.unsharded)
    if fsdp_gather == "layer":
        # two layers' weights in flight; at the backward's end the stacks' gradients are
        # reduce-scattered inside the backward scan but the last layer's, and those of the
        # arrays outside the stacks are whole
        gathered = min(gathered, params.whole + 2 * params.per_layer)
        grads_extra = min(grads_extra, params.whole + params.per_layer)
    return gathered, grads_extra
