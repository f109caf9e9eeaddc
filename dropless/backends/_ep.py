"""Expert parallelism in XLA: an all-to-all dispatcher that runs inside `jax.shard_map`.

Each device of the mesh axis `axis_name` (size `ep`) holds `experts / ep` consecutive experts
(the local slice of the `GroupedExperts` weights) and its own slice of the tokens; the router is
replicated. `AllToAllDispatcher.dispatch` then

1. sorts the local `tokens * k` copies by global expert (hence by destination device),
2. counts copies per expert and exchanges the counts (`all_gather`: every device learns the whole
   `[source, expert]` count matrix, from which every offset below is computed, identically),
3. exchanges the copies: a padded `jax.lax.all_to_all` with a static per-(source, destination)
   bound (CPU; XLA:CPU cannot compile the ragged collective), or `jax.lax.ragged_all_to_all`
   into a static receive buffer (GPU/TPU),
4. lays the received rows out expert-contiguously over the local experts (one gather through a
   permutation computed from the counts: no sort),

and `combine` walks the same plan backwards and takes the weighted sum over k.

Buffers are static and derived from shapes: by default the worst case (every copy of every source
lands on one device), so no token can ever be dropped. `recv_factor` shrinks them to a multiple of
the balanced load; copies that do not fit are counted in `Dispatched.dropped` (hence in
`MoEStats.dropped`) and the `overflow` policy either raises at run time ("raise", the default)
or drops them and reports the count ("drop"). Nothing is dropped silently. The buffer sizes and
the exchanges themselves are in `dropless.backends._ep_exchange`.
"""

from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from dropless._balance import expert_counts
from dropless._dispatch import AbstractExpertParallelDispatcher, Dispatched
from dropless._routing import JnpTopK
from dropless.backends._backend import Backend
from dropless.backends._chunked import ChunkedGroupedMatmul
from dropless.backends._ep_exchange import (
    Exchange,
    RaggedOffsets,
    axis_size,
    buffer_rows,
    check_ep_settings,
    exclusive_cumsum,
    pair_bound,
    ragged_bound,
    ragged_exchange,
    resolve_exchange,
    take_rows,
)
from dropless.backends._sort import permute_rows

Overflow = Literal["raise", "drop"]

OVERFLOW_MESSAGE = (
    "AllToAllDispatcher: token copies overflowed the expert-parallel receive buffer, which "
    "recv_factor sized below the worst case. Raise recv_factor, set recv_factor=None (the "
    "worst case: never drops), or set overflow='drop' to drop them and count them in "
    "MoEStats.dropped."
)


# --- the plan ---------------------------------------------------------------------------------


class AllToAllPlan(eqx.Module):
    """Everything `combine` needs to invert `dispatch` (all integer arrays)."""

    order: Int[Array, " copies"]  # sorted copy r is copy order[r] (sorted by global expert)
    inverse: Int[Array, " copies"]
    local_order: Int[Array, " rows"]  # dispatched row r is received row local_order[r]
    local_inverse: Int[Array, " rows"]
    # padded all-to-all: send slot of each sorted copy (out of range: dropped) and its inverse
    slot_of_copy: Int[Array, " copies"] | None = None
    copy_of_slot: Int[Array, " rows"] | None = None
    # ragged all-to-all: the dispatch exchange and its reverse
    send: RaggedOffsets | None = None
    back: RaggedOffsets | None = None


class AllToAllDispatcher(AbstractExpertParallelDispatcher):
    """Expert-parallel dispatch over the mesh axis `axis_name` (run inside `jax.shard_map`).

    - `recv_factor`: None (default) sizes the receive buffer for the worst case, so nothing can
      ever be dropped; a number > 0 sizes it to that multiple of the balanced load (see
      `buffer_rows`), and overflowing copies are handled by `overflow`.
    - `overflow`: "raise" (default) fails at run time if any copy overflowed; "drop" drops them
      (their expert contribution is zero) and counts them in `Dispatched.dropped`.
    - `exchange`: "all_to_all" (padded, any platform), "ragged" (`jax.lax.ragged_all_to_all`,
      GPU/TPU), or "auto" (ragged on GPU/TPU, padded elsewhere).

    `Dispatched.dropped` counts this device's copies that were dropped (sum over devices for the
    total); `group_sizes` has one entry per local expert.
    """

    axis_name: str = eqx.field(default="expert", static=True)
    recv_factor: float | None = eqx.field(default=None, static=True)
    overflow: Overflow = eqx.field(default="raise", static=True)
    exchange: Exchange = eqx.field(default="auto", static=True)

    requires_gpu: ClassVar[bool] = False

    def __check_init__(self):
        check_ep_settings(self.axis_name, self.recv_factor)
        if self.overflow not in ("raise", "drop"):
            raise ValueError(f"overflow must be 'raise' or 'drop', got {self.overflow!r}")
        if self.exchange not in ("auto", "all_to_all", "ragged"):
            raise ValueError(
                f"exchange must be 'auto', 'all_to_all' or 'ragged', got {self.exchange!r}"
            )

    # Over 60 lines: the steps of one exchange (sort, count, bound, send, lay out) share a
    # dozen per-device arrays; the layout of what arrives is `_expert_contiguous`.
    def _dispatch(self, x, routing):
        ep = axis_size(self.axis_name)
        tokens, k = routing.expert_ids.shape
        n_experts = routing.scores.shape[-1]
        if n_experts % ep:
            raise ValueError(
                f"n_routed_experts ({n_experts}) must be divisible by the size of mesh axis "
                f"{self.axis_name!r} ({ep}): each device holds n_routed_experts / {ep} experts"
            )
        local = n_experts // ep
        n_copies = tokens * k
        me = jax.lax.axis_index(self.axis_name)

        # 1. sort the local copies by global expert: destination blocks, expert-sorted inside
        flat_ids = routing.expert_ids.reshape(-1)
        order = jnp.argsort(flat_ids, stable=True).astype(jnp.int32)
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n_copies, dtype=jnp.int32))
        copies = jnp.broadcast_to(x[:, None, :], (tokens, k, x.shape[-1])).reshape(n_copies, -1)
        sorted_x = permute_rows(copies, order, inverse)

        # 2. exchange counts: counts[q, d, l] = copies source q sends local expert l of device d
        own = expert_counts(flat_ids, n_experts)
        counts = jax.lax.all_gather(own, self.axis_name).reshape(ep, ep, local)
        pair = counts.sum(-1)  # [source, destination]
        send_start = exclusive_cumsum(pair)  # where each destination block starts, per source

        # 3. the static bound, what fits, and where it lands
        mode = resolve_exchange(self.exchange)
        if mode == "all_to_all":
            bound = pair_bound(n_copies, ep, self.recv_factor)
            kept = jnp.minimum(pair, bound)
            land = jnp.broadcast_to(jnp.arange(ep, dtype=jnp.int32)[:, None] * bound, (ep, ep))
            n_rows = ep * bound
        else:
            n_rows = ragged_bound(n_copies, ep, self.recv_factor)
            land = exclusive_cumsum(pair, axis=0)  # source q's rows start here on destination d
            kept = jnp.clip(n_rows - land, 0, pair)
        # the first kept[q, d] copies of each (expert-sorted) block are kept
        kept_e = jnp.clip(kept[..., None] - exclusive_cumsum(counts), 0, counts)
        dropped_here = (pair[me] - kept[me]).sum()
        dropped_anywhere = (pair - kept).sum()

        if mode == "all_to_all":
            rank = jnp.arange(n_copies, dtype=jnp.int32)
            dest = flat_ids[order] // local
            j = rank - send_start[me][dest]
            # copies to no expert here (zero-computation experts' ids) are sent nowhere
            sent = (j < bound) & (dest < ep)
            slot_of_copy = jnp.where(sent, dest * bound + j, n_rows).astype(jnp.int32)
            copy_of_slot = (
                jnp.full((n_rows,), n_copies, jnp.int32).at[slot_of_copy].set(rank, mode="drop")
            )
            send_buf = take_rows(sorted_x, copy_of_slot, slot_of_copy)
            received = jax.lax.all_to_all(send_buf, self.axis_name, 0, 0, tiled=True)
            exchange_plan = dict(slot_of_copy=slot_of_copy, copy_of_slot=copy_of_slot)
        else:
            fwd = RaggedOffsets(send_start[me], kept[me], land[me], kept[:, me])
            back = RaggedOffsets(land[:, me], kept[:, me], send_start[:, me], kept[me])
            received = ragged_exchange(sorted_x, fwd, back, n_rows, self.axis_name)
            exchange_plan = dict(send=fwd, back=back)

        # 4. expert-contiguous layout of the received rows
        got = kept_e[:, me, :]  # [source, local expert]
        local_order, local_inverse = _expert_contiguous(got, land[:, me], n_rows)
        group_sizes = got.sum(0)
        rows = permute_rows(received, local_order, local_inverse)

        if self.recv_factor is not None and self.overflow == "raise":
            flag = eqx.error_if(jnp.zeros((), rows.dtype), dropped_anywhere > 0, OVERFLOW_MESSAGE)
            rows = rows + flag  # ties the check to the data path (a no-op add of zero)
        plan = AllToAllPlan(order, inverse, local_order, local_inverse, **exchange_plan)
        return Dispatched(
            rows=rows,
            group_sizes=group_sizes,
            plan=plan,
            dropped=dropped_here.astype(jnp.float32),
        )

    def _combine(self, y_rows, dispatched, routing):
        tokens, k = routing.expert_ids.shape
        plan: AllToAllPlan = dispatched.plan
        y_received = permute_rows(y_rows, plan.local_inverse, plan.local_order)
        if plan.send is None:
            back = jax.lax.all_to_all(y_received, self.axis_name, 0, 0, tiled=True)
            y_sorted = take_rows(back, plan.slot_of_copy, plan.copy_of_slot)
        else:
            y_sorted = ragged_exchange(y_received, plan.back, plan.send, tokens * k, self.axis_name)
        y_copies = permute_rows(y_sorted, plan.inverse, plan.order).reshape(tokens, k, -1)
        y = jnp.einsum("tkd,tk->td", y_copies.astype(jnp.float32), routing.weights)
        return y.astype(y_rows.dtype)


def _expert_contiguous(
    got: Int[Array, "ep experts"], land: Int[Array, " ep"], n_rows: int
) -> tuple[Int[Array, " rows"], Int[Array, " rows"]]:
    """(order, inverse) that lay the `n_rows` received rows out expert-contiguous, experts in
    order, sources in order inside each, the padding at the tail in order. `got[q, l]`: rows
    of local expert l from source q; `land[q]`: where source q's rows start. Segment (q, l)
    starts at land[q] + (rows of lower experts from q)."""
    ep, local = got.shape
    seg_start = (land[:, None] + exclusive_cumsum(got)).reshape(-1)
    seg_size = got.reshape(-1)
    row = jnp.arange(n_rows, dtype=jnp.int32)
    seg = jnp.searchsorted(seg_start, row, side="right").astype(jnp.int32) - 1
    seg_c = jnp.clip(seg, 0, ep * local - 1)
    valid = (seg >= 0) & (row < seg_start[seg_c] + seg_size[seg_c])
    q, lx = seg_c // local, seg_c % local
    group_sizes = got.sum(0)
    group_start = exclusive_cumsum(group_sizes)
    before = exclusive_cumsum(got, axis=0)  # rows of expert l from lower sources
    target = group_start[lx] + before[q, lx] + row - seg_start[seg_c]
    spare = group_sizes.sum() + jnp.cumsum(~valid) - 1  # padding goes to the tail, in order
    local_inverse = jnp.where(valid, target, spare).astype(jnp.int32)
    local_order = jnp.zeros_like(local_inverse).at[local_inverse].set(row)
    return local_order, local_inverse


def ep_backend(
    axis_name: str = "expert",
    *,
    recv_factor: float | None = None,
    overflow: Overflow = "raise",
    exchange: Exchange = "auto",
):
    """The "ep" bundle: all-to-all dispatch over `axis_name`, chunked grouped matmul, jnp top-k."""
    dispatcher = AllToAllDispatcher(
        axis_name=axis_name, recv_factor=recv_factor, overflow=overflow, exchange=exchange
    )
    return Backend(dispatcher=dispatcher, gmm=ChunkedGroupedMatmul(), topk=JnpTopK())


__all__ = [
    "AllToAllDispatcher",
    "AllToAllPlan",
    "RaggedOffsets",
    "buffer_rows",
    "ep_backend",
    "pair_bound",
    "ragged_bound",
    "ragged_exchange",
    "resolve_exchange",
    "take_rows",
]
