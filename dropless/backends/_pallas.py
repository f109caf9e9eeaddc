"""A TE-free fast grouped GEMM for Hopper GPUs, on Mosaic GPU (Pallas) kernels.

Our warp-specialised kernels (`mosaic`) compute the forward, the input gradient and, where
their tiles divide the widths, the weight gradient; elsewhere the weight gradient is JAX's
`transposed_ragged_dot_mgpu.transposed_ragged_dot`. A custom VJP ties them together. JAX's
kernels take tile sizes from a table per operation and shape (`TUNED`, empty as shipped, and the
strategy's own `tiles`, e.g. `TileTable.from_file` of what `tune_pallas.py --tiles-out` writes),
with a default that is valid whenever widths are multiples of 128.
"""

import dataclasses
import functools
import json
import pathlib
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from dropless._experts import AbstractFusedSwiGLUMatmul, AbstractGroupedMatmul, gate_up_swiglu
from dropless._routing import JnpTopK
from dropless.backends import mosaic
from dropless.backends._backend import Backend, BackendUnavailableError, is_hopper
from dropless.backends._capacity import CapacityGroupedMatmul
from dropless.backends._sort import SortDispatcher


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tile sizes of one Mosaic GPU kernel launch (the kernels' own keyword arguments)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


Op = Literal["fwd", "dgrad", "wgrad"]

# Chosen on one GPU by tune_pallas.py, keyed by the operation and the forward's (in width, out
# width): "fwd" is x @ w, "dgrad" g @ w.T, "wgrad" x.T @ g per group. Shapes not listed get the
# default BlockConfig. A strategy's `tiles` (`PallasGroupedMatmul(tiles=...)`) add to or override
# it. Empty: tilings searched on balanced groups
# alone are not exact on uneven ones (test_pallas_tiles_are_exact checks every entry), and
# tune_pallas.py keeps only the exact ones.
TUNED: dict[tuple[Op, int, int], BlockConfig] = {}


@dataclasses.dataclass(frozen=True)
class TileTable:
    """Tiles per (operation, forward in width, forward out width), adding to or overriding
    `TUNED`: a static, hashable value, so a strategy holds it as a field."""

    entries: tuple[tuple[tuple[Op, int, int], BlockConfig], ...] = ()

    @classmethod
    def from_file(cls, path: "str | pathlib.Path") -> "TileTable":
        """The entries of a tiles file (what `tune_pallas.py --tiles-out` writes): a JSON list
        of {"op", "in", "out", <BlockConfig fields>}."""
        entries = json.loads(pathlib.Path(path).read_text())
        return cls(
            tuple(
                ((e.pop("op"), e.pop("in"), e.pop("out")), BlockConfig(**e))
                for e in map(dict, entries)
            )
        )


def block_config(
    op: Op, in_width: int, out_width: int, tiles: TileTable = TileTable()
) -> BlockConfig:
    """The tuned tiles for `op` of an [in_width -> out_width] grouped matmul (`tiles`, then
    `TUNED`), checked to divide."""
    table = {**TUNED, **dict(tiles.entries)}
    cfg = table.get((op, in_width, out_width), BlockConfig())
    check_divides(op, cfg, in_width, out_width)
    return cfg


def check_divides(op: Op, cfg: BlockConfig, in_width: int, out_width: int) -> None:
    """Raise unless the tiles divide the widths as the kernel for `op` requires."""
    if op == "wgrad":  # tiles the [in out] weight by (block_m, block_n)
        rules = {"block_m": (in_width, cfg.block_m), "block_n": (out_width, cfg.block_n)}
    else:  # contracts `k` by block_k, tiles the output width by block_n * grid_block_n
        k, n = (in_width, out_width) if op == "fwd" else (out_width, in_width)
        rules = {
            "block_k": (k, cfg.block_k),
            "block_n*grid_block_n": (n, cfg.block_n * cfg.grid_block_n),
        }
    for name, (width, block) in rules.items():
        if width % block:
            raise ValueError(
                f"Pallas grouped matmul ({op}, widths {in_width} -> {out_width}): width {width} "
                f"must be a multiple of {name}={block}"
            )


@functools.cache
def load_kernels():
    if not is_hopper():  # the kernels' warpgroup matmuls exist from compute capability 9.0 only
        device = jax.devices()[0]
        raise BackendUnavailableError(
            "the Pallas grouped matmul needs an NVIDIA Hopper GPU (compute capability 9.x); "
            f"the first device is {device.device_kind} ({device.platform})"
        )
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except ImportError as err:
        raise BackendUnavailableError(
            f"Mosaic GPU kernels are not importable: {err} (they come with JAX's CUDA build, "
            "e.g. `pip install 'jax[cuda13]'`)"
        ) from err
    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def run_op(op: Op, a, b, group_sizes, cfg: BlockConfig):
    """One kernel: fwd(x, w) = x @ w[e]; dgrad(g, w) = g @ w[e].T; wgrad(x, g) = x.T @ g
    over each group's rows."""
    ragged_dot, transposed_ragged_dot = load_kernels()
    if op == "wgrad":
        return transposed_ragged_dot(a, b, group_sizes=group_sizes, **cfg.kwargs())
    return ragged_dot(a, b, group_sizes=group_sizes, transpose_rhs=op == "dgrad", **cfg.kwargs())


def reference_op(op: Op, a, b, group_sizes):
    """`run_op` in float32 plain jnp, for checking tilings: every row against every expert,
    then each row's own expert kept (O(rows * experts * width): small test shapes only)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    n_groups = group_sizes.shape[0]
    owner = jnp.repeat(jnp.arange(n_groups), group_sizes, total_repeat_length=a.shape[0])
    if op == "wgrad":
        return jnp.einsum("re,ri,ro->eio", jax.nn.one_hot(owner, n_groups), a, b)
    every = jnp.einsum("ri,eio->reo" if op == "fwd" else "ro,eio->rei", a, b)
    return jnp.take_along_axis(every, owner[:, None, None], axis=1)[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def pallas_grouped_matmul(lhs, rhs, group_sizes, tiles=TileTable()):
    """`mosaic.grouped_matmul` with an exact VJP; `tiles` serve JAX's weight-gradient kernel
    where ours cannot tile the widths."""
    return mosaic.grouped_matmul(lhs, rhs, group_sizes)


def _fwd(lhs, rhs, group_sizes, tiles):
    return pallas_grouped_matmul(lhs, rhs, group_sizes, tiles), (lhs, rhs, group_sizes)


def _bwd(tiles, res, g):
    lhs, rhs, group_sizes = res
    g = g.astype(lhs.dtype)
    dlhs = mosaic.grouped_matmul(g, rhs, group_sizes, transpose_rhs=True)
    return dlhs, _weight_grad(lhs, g, group_sizes, tiles).astype(rhs.dtype), None


pallas_grouped_matmul.defvjp(_fwd, _bwd)


def _weight_grad(lhs, g, group_sizes, tiles: TileTable):
    """Our weight-gradient kernel where its tiles divide the widths, JAX's elsewhere."""
    in_width, out_width = lhs.shape[1], g.shape[1]
    if mosaic.weight_grad_fits(in_width, out_width):
        return mosaic.grouped_weight_grad(lhs, g, group_sizes)
    cfg = block_config("wgrad", in_width, out_width, tiles)
    return run_op("wgrad", lhs, g, group_sizes, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def pallas_gate_up_swiglu(rows, w_interleaved, group_sizes, row_scale=None, tiles=TileTable()):
    """SwiGLU of the gate-and-up grouped matmul in one kernel (`mosaic.grouped_matmul_swiglu`;
    the weights interleaved by `mosaic.interleave_gate_up`), times `row_scale` per row in the
    same epilogue if given, with an exact VJP: the SwiGLU's gradient (and the scale's) from the
    saved gate and up, then our input- and weight-gradient kernels."""
    _, hidden = mosaic.grouped_matmul_swiglu(rows, w_interleaved, group_sizes, row_scale=row_scale)
    return hidden


def _swiglu_fwd(rows, w_interleaved, group_sizes, row_scale, tiles):
    gate_up, hidden = mosaic.grouped_matmul_swiglu(
        rows, w_interleaved, group_sizes, row_scale=row_scale
    )
    return hidden, (rows, w_interleaved, group_sizes, gate_up, row_scale)


def _swiglu_bwd(tiles, res, d_hidden):
    rows, w, group_sizes, gate_up, row_scale = res
    d_gate_up, d_scale = mosaic.swiglu_grad_interleaved(gate_up, d_hidden, row_scale=row_scale)
    d_gate_up = d_gate_up.astype(rows.dtype)
    if d_scale is not None:
        d_scale = d_scale.astype(row_scale.dtype)
    d_rows = mosaic.grouped_matmul(d_gate_up, w, group_sizes, transpose_rhs=True)
    d_w = _weight_grad(rows, d_gate_up, group_sizes, tiles).astype(w.dtype)
    return d_rows, d_w, None, d_scale


pallas_gate_up_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class PallasGroupedMatmul(AbstractFusedSwiGLUMatmul):
    """Grouped GEMM on Mosaic GPU kernels (Hopper, bf16/fp16), with an exact custom VJP.
    `fallback`: the strategy for expert widths the kernels cannot tile (not multiples of 128);
    without one, such widths raise. `fused_swiglu`: the experts' gate-and-up matmul computes its
    SwiGLU in the kernel's epilogue (`pallas_gate_up_swiglu`); opt-in, since the proxy-2b step
    is 3% slower with it on an H200 (benchmarks/results/train_step_h200.json). `tiles`: tile
    sizes for JAX's weight-gradient kernel, which runs where ours cannot tile the widths
    (`TileTable.from_file(path)` reads what `tune_pallas.py --tiles-out` writes)."""

    requires_gpu: ClassVar[bool] = True
    compute_dtype: str = eqx.field(default="bfloat16", static=True)
    fallback: AbstractGroupedMatmul | None = None
    fused_swiglu: bool = eqx.field(default=False, static=True)
    tiles: TileTable = eqx.field(default=TileTable(), static=True)

    def __check_init__(self):
        if self.compute_dtype not in ("bfloat16", "float16"):
            raise ValueError(
                f"PallasGroupedMatmul.compute_dtype={self.compute_dtype!r} must be 'bfloat16' "
                "or 'float16' (the Mosaic kernels multiply 16-bit floats)"
            )

    def _impl(self, lhs, rhs, group_sizes):
        in_width, out_width = rhs.shape[1:]
        if in_width % 128 or out_width % 128:
            if self.fallback is not None:
                return self.fallback(lhs, rhs, group_sizes)
            # Checked here, not in the backward: every kernel used tiles both widths.
            raise ValueError(
                f"PallasGroupedMatmul: expert weights of widths [{in_width} {out_width}]: both "
                "must be multiples of 128 (the kernels' tiles); PallasGroupedMatmul(fallback=...) "
                "sends such layers to another strategy"
            )
        dt = jnp.dtype(self.compute_dtype)
        sizes = group_sizes.astype(jnp.int32)
        out = pallas_grouped_matmul(lhs.astype(dt), rhs.astype(dt), sizes, self.tiles)
        return out.astype(lhs.dtype)

    def gate_up_swiglu(self, rows, w_gate, w_up, group_sizes, row_scale=None):
        """The fused kernel with `fused_swiglu` where its tiles divide the widths; elsewhere
        this strategy's matmul, then the SwiGLU (`experts.gate_up_swiglu`)."""
        dim, hidden = w_gate.shape[1:]
        config = mosaic.config_for(2 * hidden)
        if not self.fused_swiglu or not mosaic.matmul_fits(dim, 2 * hidden, config):
            return gate_up_swiglu(self, rows, w_gate, w_up, group_sizes, row_scale)
        dt = jnp.dtype(self.compute_dtype)
        w = mosaic.interleave_gate_up(w_gate, w_up, config).astype(dt)
        hidden_rows = pallas_gate_up_swiglu(
            rows.astype(dt), w, group_sizes.astype(jnp.int32), row_scale, self.tiles
        )
        return hidden_rows.astype(rows.dtype)


def pallas_backend() -> Backend:
    load_kernels()
    return Backend(dispatcher=SortDispatcher(), gmm=PallasGroupedMatmul(), topk=JnpTopK())


def pallas_auto_backend() -> Backend:
    """The "pallas" bundle of 'auto': widths the kernels cannot tile run on jnp-capacity."""
    load_kernels()
    gmm = PallasGroupedMatmul(fallback=CapacityGroupedMatmul())
    return Backend(dispatcher=SortDispatcher(), gmm=gmm, topk=JnpTopK())
