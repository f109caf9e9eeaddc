"""Transformer Engine backend (NVIDIA GPUs): fused router top-k, permutation, grouped GEMM.

Transformer Engine is imported here and nowhere else, on first use. Every stage computes what
the jnp stage of the same role computes (tests hold them together on the GPU); parameters stay in
dropless' layout.

    pip install "transformer-engine[jax]"      # needs CUDA; see docs/backends.md
"""

import ctypes
import functools
import importlib
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from dropless._dispatch import AbstractDispatcher, Dispatched
from dropless._experts import AbstractGroupedMatmul
from dropless._routing import AbstractTopK, JnpTopK, Routing, RoutingSpec, score
from dropless.backends._backend import Backend, BackendUnavailableError
from dropless.backends._sort import SortDispatcher

_V2_MIN_CUBLASLT = 130300  # TE's newer grouped GEMM needs run-time cuBLASLt 13.3+


def _runtime_cublaslt_version() -> int:
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name).cublasLtGetVersion()
        except OSError:
            continue
    return -1


@functools.cache
def load_te():
    """Imports Transformer Engine for JAX and picks its grouped-GEMM path, once per process,
    when a TE strategy is first built or run (importing this module does neither).

    The one place where the grouped-GEMM path is chosen, and a process-wide effect: TE 2.20
    enables its newer ("v2") grouped GEMM from the cuBLAS it was *built* with, but the kernel
    needs the *run-time* cuBLASLt to be 13.3 or newer. Where the run-time library is older this
    switches TE's own (private) flag to its multi-stream path, which works with any cuBLAS,
    for every user of TE in the process.
    """
    try:
        import transformer_engine.jax  # noqa: F401  (loads the C++ extension)

        # the module, not the `gemm` function that cpp_extensions re-exports under that name
        gemm = importlib.import_module("transformer_engine.jax.cpp_extensions.gemm")
    except ImportError as err:
        raise BackendUnavailableError(
            "the Transformer Engine backend needs `pip install 'transformer-engine[jax]'` "
            f"(import failed: {err})"
        ) from err
    if not any(d.platform == "gpu" for d in jax.devices()):
        raise BackendUnavailableError("the Transformer Engine backend needs an NVIDIA GPU")
    version = _runtime_cublaslt_version()
    if getattr(gemm, "_v2_grouped_gemm_available", False) and version < _V2_MIN_CUBLASLT:
        gemm._v2_grouped_gemm_available = False
        gemm._v2_grouped_gemm_available_reason = (
            f"dropless: run-time cuBLASLt {version} < {_V2_MIN_CUBLASLT}"
        )
    from transformer_engine.jax import dense, permutation, router

    return dense, permutation, router


def grouped_gemm_path() -> str:
    """'v2' (cuBLAS grouped GEMM) or 'multi-stream': which TE path grouped_dense takes here."""
    load_te()
    gemm = importlib.import_module("transformer_engine.jax.cpp_extensions.gemm")
    return "v2" if getattr(gemm, "_v2_grouped_gemm_available", False) else "multi-stream"


class TEGroupedMatmul(AbstractGroupedMatmul):
    """`transformer_engine.jax.dense.grouped_dense`: cuBLAS grouped GEMM, forward and backward,
    in the operands' dtype (bf16 recommended)."""

    requires_gpu: ClassVar[bool] = True

    def _impl(self, lhs, rhs, group_sizes):
        dense, _, _ = load_te()
        rows, used = lhs.shape[0], jnp.sum(group_sizes)
        # grouped_dense covers exactly sum(group_sizes) rows; a longer buffer's tail rows are
        # given to the last group (their outputs are ignored by every caller).
        group_sizes = group_sizes.at[-1].add(rows - used).astype(jnp.int32)
        out = dense.grouped_dense(lhs, rhs.astype(lhs.dtype), group_sizes)
        return out.astype(lhs.dtype)


def _te_supports(spec: RoutingSpec) -> bool:
    """TE's fused router computes exactly our rule for these settings (and not others)."""
    if spec.n_group > 1 and spec.group_score != "top2_sum":
        return False
    # TE's kernel asserts topk % group_topk == 0 (seen on the H200 with top-6 of 4 groups)
    if spec.n_group > 1 and spec.num_experts_per_tok % spec.topk_group:
        return False
    if spec.scoring_func == "softmax":
        if spec.use_expert_bias:
            return False
        # pre-softmax top-k keeps raw probabilities; post-softmax normalises over the k.
        return not spec.norm_topk_prob if spec.softmax_before_topk else True
    # sigmoid / sqrtsoftplus: TE always renormalises the k weights (for k > 1)
    return spec.norm_topk_prob or spec.num_experts_per_tok == 1


class TETopK(AbstractTopK):
    """TE's fused `fused_topk_with_score_function`. Settings TE does not compute exactly (see
    `_te_supports`) fall back to `JnpTopK`, so the routing rule never changes with the backend."""

    requires_gpu: ClassVar[bool] = True

    def _impl(self, logits, bias, spec):
        if not _te_supports(spec):
            return JnpTopK()(logits, bias, spec)
        _, _, router = load_te()
        probs, routing_map = router.fused_topk_with_score_function(
            logits,
            topk=spec.num_experts_per_tok,
            use_pre_softmax=spec.softmax_before_topk,
            num_groups=spec.n_group if spec.n_group > 1 else -1,
            group_topk=spec.topk_group if spec.n_group > 1 else -1,
            scaling_factor=float(spec.routed_scaling_factor),
            score_function=spec.scoring_func,
            expert_bias=bias,
        )
        # The chosen experts, lowest id first (a set: the order carries no meaning).
        chosen = jnp.argsort(~routing_map, axis=-1, stable=True)[:, : spec.num_experts_per_tok]
        weights = jnp.take_along_axis(probs, chosen, axis=-1).astype(jnp.float32)
        return Routing(
            expert_ids=chosen.astype(jnp.int32),
            weights=weights,
            scores=score(logits, spec.scoring_func),
            logits=logits,
        )


class TEPlan(eqx.Module):
    row_id_map: jax.Array


def _dense_weights(routing: Routing) -> jax.Array:
    n_experts = routing.scores.shape[-1]
    one_hot = jax.nn.one_hot(routing.expert_ids, n_experts, dtype=routing.weights.dtype)
    return jnp.einsum("tke,tk->te", one_hot, routing.weights)


class TEDispatcher(AbstractDispatcher):
    """TE's Triton permutation kernels (`token_dispatch` / `token_combine`).

    Exact in a single layer, forward and gradients (GPU tests). Inside `jax.lax.scan` its
    gradients are wrong: with two scanned MoE layers of proxy-2b's shape the router weights'
    gradient has relative error 1.0 against jnp-capacity and the experts' gradients are NaN
    (TE 2.20.2, jax 0.11.2, H200, 2026-12-03), and the proxy-2b loss climbed to 13 in four
    steps. The models scan their layers, so no registered bundle uses it.
    """

    requires_gpu: ClassVar[bool] = True

    def _dispatch(self, x, routing):
        _, permutation, _ = load_te()
        tokens, k = routing.expert_ids.shape
        routing_map = jnp.any(
            jax.nn.one_hot(routing.expert_ids, routing.scores.shape[-1], dtype=bool), axis=1
        )
        rows, _, row_id_map, _, group_sizes = permutation.token_dispatch(x, routing_map, tokens * k)
        return Dispatched(
            rows=rows, group_sizes=group_sizes.astype(jnp.int32), plan=TEPlan(row_id_map)
        )

    def _combine(self, y_rows, dispatched, routing):
        _, permutation, _ = load_te()
        probs = _dense_weights(routing).astype(y_rows.dtype)
        return permutation.token_combine(y_rows, dispatched.plan.row_id_map, probs)


def te_backend() -> Backend:
    """TE's fused top-k and grouped GEMM, with dropless' sort dispatcher (see `TEDispatcher`
    for why TE's permutation is not part of it)."""
    load_te()
    return Backend(dispatcher=SortDispatcher(), gmm=TEGroupedMatmul(), topk=TETopK())


def te_gmm_backend() -> Backend:
    """TE's grouped GEMM with dropless' sort dispatcher and router (a mix of stages)."""
    load_te()
    return Backend(dispatcher=SortDispatcher(), gmm=TEGroupedMatmul(), topk=JnpTopK())
