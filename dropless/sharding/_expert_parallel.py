"""Expert parallelism on a mesh: the checks that a model can run on one, the MoE statistics of
the whole batch from those of each shard, and `ShardedMoE`, one MoE layer run expert-parallel by
`jax.shard_map`.

Inside the `jax.shard_map` each device sees its slice of the batch, the full router and dense
weights, and the local slice `[experts / ep ...]` of every `GroupedExperts` weight; the MoE layers
must use an expert-parallel dispatcher (`dropless.with_backend(model, ep_backend())`)."""

import equinox as eqx
import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PyTree

from dropless import _balance as balance
from dropless._dispatch import AbstractDispatcher, AbstractExpertParallelDispatcher
from dropless._moe import MoE, MoEStats
from dropless.sharding._mesh import AXIS_RULES, axes_size, batch_axes, batch_spec
from dropless.sharding._specs import FSDP_MIN_SIZE, fsdp_specs, gather_fsdp, param_specs


def dispatchers(model: PyTree) -> list[AbstractDispatcher]:
    """Every dispatcher strategy inside `model` (one per MoE stack)."""
    nodes = jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, AbstractDispatcher))
    return [node for node in nodes if isinstance(node, AbstractDispatcher)]


def check_expert_parallel(model: PyTree, mesh: Mesh) -> None:
    """Raises if `model` cannot run sharded on `mesh`: a dispatcher that cannot move tokens
    between devices while the expert axis is > 1, a dispatcher whose axis the mesh lacks or
    that is not the expert axis, or a number of experts that the expert axis does not divide."""
    ep = mesh.shape.get("expert", 1)
    for node in dispatchers(model):
        parallel = isinstance(node, AbstractExpertParallelDispatcher)
        if ep > 1 and not parallel:
            raise ValueError(
                f"{type(node).__name__} cannot dispatch across devices, and the mesh's expert axis "
                f"has size {ep}; use dropless.with_backend(model, ep_backend()) (or expert=1)"
            )
        if not parallel:
            continue
        axis = node.axis_name
        if axis not in mesh.shape:
            raise ValueError(
                f"{type(node).__name__}.axis_name is {axis!r}, which is not an axis of the mesh "
                f"{dict(mesh.shape)}"
            )
        expert_axes = AXIS_RULES["experts"]
        if axis not in expert_axes and mesh.shape.get(axis, 1) > 1:
            raise ValueError(
                f"{type(node).__name__}.axis_name is {axis!r}, but the experts are split over "
                f"{expert_axes[0]!r} (size {ep}); dispatch over that axis"
            )
    arrays = eqx.filter(model, eqx.is_array)
    param_specs(arrays, mesh, fsdp_min_size=2**62)  # raises on indivisible experts


def reduce_moe_stats(stats: MoEStats, axes: tuple[str, ...]) -> MoEStats:
    """Inside shard_map: MoE statistics of the whole batch from those of each shard.

    Counts and drops are summed, MaxVio is recomputed from the summed counts, the losses are
    averaged over shards: exact for the z-loss and (sequences never straddle shards) the
    sequence-wise loss; the batch-wise balance loss becomes the mean of per-shard losses.
    """
    if not axes:
        return stats
    counts = jax.lax.psum(stats.tokens_per_expert, axes)
    return MoEStats(
        tokens_per_expert=counts,
        max_vio=balance.max_violation(counts),
        balance_loss=jax.lax.pmean(stats.balance_loss, axes),
        seq_balance_loss=jax.lax.pmean(stats.seq_balance_loss, axes),
        z_loss=jax.lax.pmean(stats.z_loss, axes),
        dropped=jax.lax.psum(stats.dropped, axes),
        router_probability=jax.lax.pmean(stats.router_probability, axes),
        router_entropy=jax.lax.pmean(stats.router_entropy, axes),
        zero_tokens=jax.lax.psum(stats.zero_tokens, axes),
        active_experts=jax.lax.pmean(stats.active_experts, axes),
    )


# --- an MoE layer on a mesh --------------------------------------------------------------------


class ShardedMoE(eqx.Module):
    """An MoE layer run by `jax.shard_map` over `mesh`: call it on global tokens `[tokens dim]`
    (split over `batch_axes`), get global outputs and `MoEStats` of the whole batch as
    `reduce_moe_stats` forms them: counts and MaxVio of all tokens, the losses averaged over
    shards. With `seq_len=None` each shard's tokens count as one sequence, so the sequence-wise
    (and the batch-wise) balance loss differ from one `MoE` call on all the tokens; pass the
    sequence length to make the sequence-wise loss exact.

    `moe` holds global arrays; inside, each device sees its slice of the experts. Differentiable
    with respect to `moe` and the tokens. The tokens must divide evenly over the batch axes.
    """

    moe: MoE
    mesh: Mesh = eqx.field(static=True)
    seq_len: int | None = eqx.field(default=None, static=True)
    fsdp_min_size: int = eqx.field(default=FSDP_MIN_SIZE, static=True)

    def __call__(
        self, x: Float[Array, "tokens dim"]
    ) -> tuple[Float[Array, "tokens dim"], MoEStats]:
        axes = batch_axes(self.mesh)
        shards = axes_size(self.mesh, axes)
        if x.shape[0] % shards:
            raise ValueError(
                f"tokens ({x.shape[0]}) must be divisible by the batch shards ({shards}: mesh axes "
                f"{axes})"
            )
        arrays, static = eqx.partition(self.moe, eqx.is_array)
        specs = param_specs(arrays, self.mesh, fsdp_min_size=self.fsdp_min_size)
        gathers = fsdp_specs(arrays, self.mesh, fsdp_min_size=self.fsdp_min_size)

        def local(arrays, x):
            moe = eqx.combine(gather_fsdp(arrays, gathers), static)
            y, stats = moe(x, seq_len=self.seq_len)
            return y, reduce_moe_stats(stats, axes)

        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(specs, batch_spec(self.mesh)),
            out_specs=(batch_spec(self.mesh), P()),
            check_vma=False,
        )(arrays, x)


def shard_moe(
    moe: MoE, mesh: Mesh, *, seq_len: int | None = None, fsdp_min_size: int = FSDP_MIN_SIZE
) -> ShardedMoE:
    """Wraps `moe` to run expert-parallel on `mesh` (checks it can: see `check_expert_parallel`).

    `seq_len` groups each shard's tokens into sequences for the sequence-wise balance loss.
    """
    check_expert_parallel(moe, mesh)
    return ShardedMoE(moe, mesh, seq_len, fsdp_min_size)
