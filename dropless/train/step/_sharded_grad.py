"""`sharded_value_and_grad`: a loss's value and gradient run SPMD over a device mesh, each
device on its slice of the batch, FSDP-sharded arrays gathered where they are used (those of
the scanned layer stacks one layer at a time, `layer_gathering`)."""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from dropless import sharding
from dropless.models.deepseek_v3._block import DecoderBlock
from dropless.models.deepseek_v3._layers import gathering_layers
from dropless.models.deepseek_v3._mtp import MTPModule


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

    def fn(model, batch):
        sharding.check_expert_parallel(model, mesh)
        diff, rest = eqx.partition(model, diff_filter)
        rest, static = eqx.partition(rest, eqx.is_array)
        specs = _specs(diff, rest, mesh, fsdp_min_size)
        loss, aux, grads = jax.shard_map(
            _local_value_and_grad(loss_fn, has_aux, static, specs, mesh),
            mesh=mesh,
            in_specs=(specs.diff, specs.rest, sharding.batch_spec(mesh)),
            out_specs=(P(), P(), specs.diff),
            check_vma=False,
        )(diff, rest, batch)
        return ((loss, aux) if has_aux else loss), grads

    return fn


class _Specs(NamedTuple):
    """How the differentiated arrays (`diff`) and the rest of a model sit on the mesh."""

    diff: PyTree  # `sharding.param_specs` of each part
    rest: PyTree
    top_diff: PyTree  # what is gathered before the model runs (`layer_gathering`)
    top_rest: PyTree
    gather_layer: Callable[[PyTree], PyTree]  # the per-layer gather, for `gathering_layers`


def _specs(diff: PyTree, rest: PyTree, mesh: Mesh, fsdp_min_size: int) -> _Specs:
    diff_gathers = sharding.fsdp_specs(diff, mesh, fsdp_min_size=fsdp_min_size)
    rest_gathers = sharding.fsdp_specs(rest, mesh, fsdp_min_size=fsdp_min_size)
    top_gathers, gather_layer = layer_gathering(eqx.combine(diff_gathers, rest_gathers))
    return _Specs(
        diff=sharding.param_specs(diff, mesh, fsdp_min_size=fsdp_min_size),
        rest=sharding.param_specs(rest, mesh, fsdp_min_size=fsdp_min_size),
        top_diff=_like(diff_gathers, top_gathers),
        top_rest=_like(rest_gathers, top_gathers),
        gather_layer=gather_layer,
    )


def _local_value_and_grad(
    loss_fn: Callable[[PyTree, PyTree], Any], has_aux: bool, static: PyTree, specs: _Specs, mesh
) -> Callable[[PyTree, PyTree, PyTree], tuple[Any, Any, PyTree]]:
    """What each device runs inside `jax.shard_map`: `(diff, rest, batch slice) -> (loss, aux,
    grads)`, the loss and aux averaged over the batch shards and the gradient of the whole
    batch's loss (each slice's loss divided by the shard count, summed where replicated)."""
    axes = sharding.batch_axes(mesh)
    shards = math.prod(mesh.shape[a] for a in axes)

    def local(diff, rest, batch):
        def scaled(diff):
            model = eqx.combine(
                sharding.gather_fsdp(diff, specs.top_diff),
                sharding.gather_fsdp(rest, specs.top_rest),
                static,
            )
            with gathering_layers(specs.gather_layer):
                out = loss_fn(model, batch)
            loss, aux = out if has_aux else (out, None)
            return loss / shards, (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(diff)
        grads = _sum_unsharded(grads, specs.diff, mesh)
        if axes:
            loss = jax.lax.pmean(loss, axes)
            aux = jax.tree.map(lambda a: jax.lax.pmean(a, axes), aux)
        return loss, aux, grads

    return local


def _like(part: PyTree, top: PyTree) -> PyTree:
    """`top`'s specs where `part` has one (None elsewhere)."""
    return jax.tree.map(
        lambda p, t: None if p is None else t, part, top, is_leaf=lambda n: n is None
    )
