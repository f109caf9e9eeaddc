"""A TE-free fast grouped GEMM for Hopper GPUs, on JAX's own Mosaic GPU (Pallas) kernels.

Forward: `ragged_dot_mgpu.ragged_dot`; input gradient: the same kernel with `transpose_rhs`;
weight gradient: `transposed_ragged_dot_mgpu.transposed_ragged_dot`. A custom VJP ties them
together. Block sizes come from a small table keyed by the shapes (see `block_config`).
"""

import dataclasses
import functools
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from dropless.backends import Backend, BackendUnavailableError
from dropless.backends.jnp import SortDispatcher
from dropless.experts import AbstractGroupedMatmul
from dropless.routing import JnpTopK


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


# Chosen on one H200 by experiments/bench_moe.py --tune (see docs/benchmarks.md); keyed by
# (contracted width, output width). Anything else gets the default, which is valid whenever
# the widths are multiples of 128.
TUNED: dict[tuple[int, int], BlockConfig] = {}
TUNED_WGRAD: dict[tuple[int, int], BlockConfig] = {}  # keyed by (input width, output width)


def block_config(k: int, n: int) -> BlockConfig:
    cfg = TUNED.get((k, n), BlockConfig())
    if k % cfg.block_k or n % (cfg.block_n * cfg.grid_block_n):
        raise ValueError(
            f"Pallas grouped matmul: widths (contracted {k}, output {n}) must be multiples of "
            f"block_k={cfg.block_k} and block_n*grid_block_n={cfg.block_n * cfg.grid_block_n}"
        )
    return cfg


@functools.cache
def load_kernels():
    if not any(d.platform == "gpu" for d in jax.devices()):
        raise BackendUnavailableError("the Pallas grouped matmul needs an NVIDIA Hopper GPU")
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except ImportError as err:
        raise BackendUnavailableError(f"Mosaic GPU kernels are not importable: {err}") from err
    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


@jax.custom_vjp
def pallas_grouped_matmul(lhs, rhs, group_sizes):
    ragged_dot, _ = load_kernels()
    cfg = block_config(lhs.shape[1], rhs.shape[2])
    return ragged_dot(lhs, rhs, group_sizes=group_sizes, **cfg.kwargs())


def _fwd(lhs, rhs, group_sizes):
    return pallas_grouped_matmul(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _bwd(res, g):
    lhs, rhs, group_sizes = res
    ragged_dot, transposed_ragged_dot = load_kernels()
    g = g.astype(lhs.dtype)
    # d lhs = g @ rhs[e].T: the forward kernel reading rhs transposed (contracting `out`)
    cfg = block_config(rhs.shape[2], rhs.shape[1])
    dlhs = ragged_dot(g, rhs, group_sizes=group_sizes, transpose_rhs=True, **cfg.kwargs())
    # d rhs[e] = lhs[rows of e].T @ g[rows of e]; this kernel tiles (in, out) by (block_m, block_n)
    wcfg = TUNED_WGRAD.get((lhs.shape[1], rhs.shape[2]), BlockConfig())
    if lhs.shape[1] % wcfg.block_m or rhs.shape[2] % wcfg.block_n:
        raise ValueError(
            f"Pallas weight gradient: widths ({lhs.shape[1]}, {rhs.shape[2]}) must be multiples "
            f"of block_m={wcfg.block_m} and block_n={wcfg.block_n}"
        )
    drhs = transposed_ragged_dot(lhs, g, group_sizes=group_sizes, **wcfg.kwargs())
    return dlhs, drhs.astype(rhs.dtype), None


pallas_grouped_matmul.defvjp(_fwd, _bwd)


class PallasGroupedMatmul(AbstractGroupedMatmul):
    """Grouped GEMM on Mosaic GPU kernels (Hopper, bf16/fp16), with an exact custom VJP."""

    requires_gpu: ClassVar[bool] = True
    compute_dtype: str = eqx.field(default="bfloat16", static=True)

    def _impl(self, lhs, rhs, group_sizes):
        dt = jnp.dtype(self.compute_dtype)
        out = pallas_grouped_matmul(lhs.astype(dt), rhs.astype(dt), group_sizes.astype(jnp.int32))
        return out.astype(lhs.dtype)


def pallas_backend() -> Backend:
    load_kernels()
    return Backend(dispatcher=SortDispatcher(), gmm=PallasGroupedMatmul(), topk=JnpTopK())
