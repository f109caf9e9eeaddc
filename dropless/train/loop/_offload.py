"""Optimizer-state host offload (`TrainConfig.offload_optimizer`, `--offload-optimizer`).

Adam's moments (every floating-point array of the optimiser state with at least one dimension)
live in pinned host memory between steps, sharded as on the device. The step moves them to the
device inside the jitted step (`jax.device_put(..., jax.memory.Space.Device)`), runs the
unchanged train step, and moves the new moments back; the parameters, gradients and
everything else stay on the device. The device then holds the moments only during the update,
after the backward pass has freed its activations (`dropless plan --offload-optimizer`
counts them on the host). The arithmetic is that of the in-device step.

    state = to_host(state)                                   # once, after init or restore
    state, metrics = train_step(mesh, state, tokens)         # mesh None: one device
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Int, PyTree

from dropless import sharding
from dropless.train.step import _step as step_lib
from dropless.train.step._sharded import sharded_train_step
from dropless.train.step._step import TrainState

HOST = "pinned_host"


def is_moment(leaf) -> bool:
    """An optimiser-state array that offload moves: floating point, not a scalar."""
    return eqx.is_inexact_array(leaf) and leaf.ndim >= 1


def _map_moments(state: TrainState, fn) -> TrainState:
    opt_state = jax.tree.map(lambda x: fn(x) if is_moment(x) else x, state.opt_state)
    return eqx.tree_at(lambda s: s.opt_state, state, opt_state, is_leaf=lambda x: x is None)


def to_host(state: TrainState) -> TrainState:
    """`state` with its moments placed in pinned host memory, sharded as they were."""
    return _map_moments(state, lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST)))


def moment_memory_kinds(state: TrainState) -> set[str]:
    """The memory kinds that hold `state`'s moments (e.g. {"pinned_host"} after `to_host`)."""
    leaves = [x for x in jax.tree.leaves(state.opt_state) if is_moment(x)]
    return {x.sharding.memory_kind for x in leaves}


@eqx.filter_jit(donate="all-except-first")
def _step(
    mesh: Mesh | None, state: TrainState, tokens: Int[Array, "batch window"], micro_batches: int
) -> tuple[TrainState, dict[str, Array]]:
    state = _map_moments(state, lambda x: jax.device_put(x, jax.memory.Space.Device))
    if mesh is None:
        state, metrics = step_lib.train_step(state, tokens, micro_batches)
    else:
        state, metrics = sharded_train_step(mesh, state, tokens, micro_batches)
    return _map_moments(state, lambda x: jax.device_put(x, jax.memory.Space.Host)), metrics


def train_step(
    mesh: Mesh | None, state: TrainState, tokens: np.ndarray, micro_batches: int = 1
) -> tuple[TrainState, dict[str, Array]]:
    """One train step (`step.train_step`, or `sharded_train_step` on `mesh`) of a state whose
    moments are on the host (`to_host`); they are on the host again afterwards. `tokens` are
    host rows (this process's, with several processes). `state` is donated."""
    tokens = jnp.asarray(tokens) if mesh is None else sharding.shard_batch(tokens, mesh)
    return _step(mesh, state, tokens, micro_batches)


def state_bytes(tree: PyTree, memory_kind: str) -> int:
    """Bytes of `tree`'s arrays held in `memory_kind` on this process's devices."""
    total = 0
    for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        if leaf.sharding.memory_kind == memory_kind:
            total += sum(s.data.nbytes for s in leaf.addressable_shards)
    return total
