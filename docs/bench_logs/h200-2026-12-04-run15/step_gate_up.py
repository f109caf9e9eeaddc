"""The proxy-2b batch-8 step (pallas, cuDNN attention, layers unrolled): gate and up as one
matmul on side-by-side weights (library since this run) against two matmuls (before), and the
library with AdamW's moments in bf16; one process. A measurement aid for the fifteenth run,
not library code; run from experiments/ (or with it on PYTHONPATH)."""

import contextlib
import functools

import bench_train
import jax
from bench_train import compare, patched

from dropless.experts import GroupedExperts
from dropless.models.deepseek_v3 import get_preset
from dropless.nn.mlp import SwiGLU
from dropless.train import TrainConfig


def experts_two_matmuls(self, rows, group_sizes):  # GroupedExperts.__call__ before this run
    with jax.named_scope("experts"):
        dt = rows.dtype
        gate = self.gmm(rows, self.w_gate.astype(dt), group_sizes)
        up = self.gmm(rows, self.w_up.astype(dt), group_sizes)
        return self.gmm(jax.nn.silu(gate) * up, self.w_down.astype(dt), group_sizes)


def swiglu_two_matmuls(self, x):  # SwiGLU.__call__ before this run
    dt = x.dtype
    h = jax.nn.silu(x @ self.w_gate.astype(dt)) * (x @ self.w_up.astype(dt))
    return h @ self.w_down.astype(dt)


@contextlib.contextmanager
def two_matmuls():
    with (
        patched(GroupedExperts, "__call__", experts_two_matmuls),
        patched(SwiGLU, "__call__", swiglu_two_matmuls),
    ):
        yield


bf16_moments = functools.partial(TrainConfig, moments_dtype="bfloat16")
config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
compare(
    config,
    "pallas",
    {
        "gate and up as one matmul (library)": contextlib.nullcontext,
        "gate and up as two matmuls (before)": two_matmuls,
        "one matmul, bf16 AdamW moments": lambda: patched(bench_train, "TrainConfig", bf16_moments),
    },
)
