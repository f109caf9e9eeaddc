"""Meshes, the ONE table from logical axes to mesh axes, sharded parameters, optimizer state
and batches, and `ShardedMoE`: one MoE layer run expert-parallel by `jax.shard_map`.

The mesh has up to three named axes, outermost first: `data` (pure data parallelism), `fsdp`
(data parallelism whose devices also split the storage of large parameters and of their optimizer
state) and `expert` (data parallelism whose devices also split the routed experts: expert
parallelism, innermost so that the all-to-all stays on the fastest links). Tokens are split over
all three. Nothing in here is global: the caller builds the mesh and hands it to these functions.

`_mesh` (the axes and the table), `_specs` (parameters, optimizer state and batches on the mesh,
the fsdp all-gather), `_expert_parallel` (checks, `ShardedMoE`). The train step on a mesh is
`dropless.train.step.sharded_train_step`.
"""

from dropless.sharding._expert_parallel import (
    ShardedMoE,
    check_expert_parallel,
    dispatchers,
    reduce_moe_stats,
    shard_moe,
)
from dropless.sharding._mesh import (
    AXIS_RULES,
    MESH_AXES,
    axes_size,
    batch_axes,
    batch_spec,
    make_mesh,
    mesh_axes,
    mesh_from_spec,
    parse_mesh,
)
from dropless.sharding._specs import (
    FSDP_MIN_SIZE,
    fsdp_specs,
    gather_fsdp,
    is_array_like,
    logical_param_specs,
    opt_state_specs,
    param_specs,
    shard_batch,
    shard_model,
    to_mesh_spec,
)

__all__ = [
    "AXIS_RULES",
    "FSDP_MIN_SIZE",
    "MESH_AXES",
    "ShardedMoE",
    "fsdp_specs",
    "is_array_like",
    "axes_size",
    "batch_axes",
    "batch_spec",
    "check_expert_parallel",
    "dispatchers",
    "gather_fsdp",
    "logical_param_specs",
    "make_mesh",
    "mesh_axes",
    "mesh_from_spec",
    "opt_state_specs",
    "param_specs",
    "parse_mesh",
    "reduce_moe_stats",
    "shard_batch",
    "shard_model",
    "shard_moe",
    "to_mesh_spec",
]
