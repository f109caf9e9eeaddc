"""The parts of expert parallelism around `AllToAllDispatcher` (`dropless.backends._ep`): the
static receive-buffer sizes, gathers through partial permutations whose gradients are gathers
too, the ragged all-to-all whose gradient is the reverse exchange, and the checks of an
expert-parallel dispatcher's settings."""

import functools
import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

Exchange = Literal["auto", "all_to_all", "ragged"]


def resolve_exchange(exchange: Exchange, platform: str | None = None) -> str:
    """'auto' -> 'ragged' on GPU/TPU, 'all_to_all' elsewhere (XLA:CPU cannot compile
    `ragged_all_to_all`)."""
    if exchange != "auto":
        return exchange
    platform = platform or jax.default_backend()
    return "ragged" if platform in ("gpu", "cuda", "rocm", "tpu") else "all_to_all"


def buffer_rows(
    copies: int, ep: int, recv_factor: float | None, exchange: Literal["all_to_all", "ragged"]
) -> int:
    """Static receive rows on one device, for `copies = tokens * k` local copies per device.

    - "all_to_all": `ep` blocks of `bound` rows, one per source; `bound = copies` (worst case:
      every copy of that source comes here) or `ceil(recv_factor * copies / ep)`, capped there.
    - "ragged": one buffer of `ep * copies` rows (worst case) or `ceil(recv_factor * copies)`,
      capped there.

    `recv_factor` is a multiple of the balanced load (`copies` rows per device); values >= `ep`
    are the worst case.
    """
    if exchange == "all_to_all":
        return ep * pair_bound(copies, ep, recv_factor)
    return ragged_bound(copies, ep, recv_factor)


def pair_bound(copies: int, ep: int, recv_factor: float | None) -> int:
    """Rows one source may send one destination in the padded all-to-all."""
    if recv_factor is None:
        return max(copies, 1)
    return max(1, min(copies, math.ceil(recv_factor * copies / ep)))


def ragged_bound(copies: int, ep: int, recv_factor: float | None) -> int:
    """Rows one device may receive in all, with the ragged all-to-all."""
    if recv_factor is None:
        return max(ep * copies, 1)
    return max(1, min(ep * copies, math.ceil(recv_factor * copies)))


# --- gathers through partial permutations, with gather-only gradients -------------------------


@jax.custom_vjp
def take_rows(
    x: Float[Array, "n dim"], index: Int[Array, " m"], inverse: Int[Array, " n"]
) -> Float[Array, "m dim"]:
    """out[r] = x[index[r]], or 0 where index[r] is out of range (an empty slot).

    `inverse` is the partial inverse (x row i went to out row inverse[i], or out of range if it
    went nowhere), so the gradient is a gather too: no scatter-add, deterministic.
    """
    return x.at[index].get(mode="fill", fill_value=0)


def _take_fwd(x, index, inverse):
    return take_rows(x, index, inverse), (index, inverse)


def _take_bwd(res, g):
    index, inverse = res
    return g.at[inverse].get(mode="fill", fill_value=0), None, None


take_rows.defvjp(_take_fwd, _take_bwd)


def exclusive_cumsum(x: Array, axis: int = -1) -> Array:
    """The sum of the entries before each one along `axis` (0 for the first)."""
    return jnp.cumsum(x, axis=axis) - x


# --- the ragged exchange, with the reverse exchange as its gradient ---------------------------


def _ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    # One indirection, so tests on CPU can stand an all_gather-based emulation in for it.
    return jax.lax.ragged_all_to_all(
        operand,
        output,
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=axis_name,
    )


class RaggedOffsets(eqx.Module):
    """The four offset/size vectors of one `ragged_all_to_all` call (one entry per device)."""

    input_offsets: Int[Array, " ep"]
    send_sizes: Int[Array, " ep"]
    output_offsets: Int[Array, " ep"]
    recv_sizes: Int[Array, " ep"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def ragged_exchange(
    x: Float[Array, "n dim"],
    fwd: RaggedOffsets,
    bwd: RaggedOffsets,
    rows: int,
    axis_name: str,
) -> Float[Array, "rows dim"]:
    """Ragged all-to-all of `x` into a zero buffer of `rows` rows; `bwd` describes the reverse
    exchange, which is the gradient (rows that were not received get no gradient)."""
    out = jnp.zeros((rows, *x.shape[1:]), x.dtype)
    return _ragged_all_to_all(
        x,
        out,
        fwd.input_offsets,
        fwd.send_sizes,
        fwd.output_offsets,
        fwd.recv_sizes,
        axis_name=axis_name,
    )


def _exchange_fwd(x, fwd, bwd, rows, axis_name):
    return ragged_exchange(x, fwd, bwd, rows, axis_name), (x.shape[0], fwd, bwd)


def _exchange_bwd(rows, axis_name, res, g):
    n, fwd, bwd = res
    return ragged_exchange(g, bwd, fwd, n, axis_name), None, None


ragged_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def axis_size(axis_name: str) -> int:
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"AllToAllDispatcher(axis_name={axis_name!r}) must run inside jax.shard_map over a "
            f"mesh with a {axis_name!r} axis (the expert weights then hold the local experts); "
            "wrap the layer with dropless.sharding.shard_moe, or the loss with "
            "dropless.train.step._sharded_grad.sharded_value_and_grad"
        ) from None


def check_ep_settings(axis_name, recv_factor) -> None:
    """The settings an expert-parallel dispatcher shares: a mesh axis name, and a receive
    buffer factor (None: the worst case)."""
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"axis_name must be a non-empty mesh axis name, got {axis_name!r}")
    f = recv_factor
    if f is not None and (
        isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0
    ):
        raise ValueError(
            f"recv_factor must be None (worst-case buffer, never drops) or a finite number "
            f"> 0 (a multiple of the balanced load), got {f!r}"
        )
