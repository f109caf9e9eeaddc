"""The proxy-2b batch-8 step (pallas, cuDNN attention, layers unrolled) with AdamW's moments
stored in float32 (default) and in bf16 (`TrainConfig.moments_dtype`); one process. Each
variant prints the dtypes its optimiser state really holds (call B's bf16 row never ran bf16:
its patched TrainConfig lost to bench's own moments_dtype argument). A measurement aid for the
fifteenth run, not library code; run from experiments/ (or with it on PYTHONPATH)."""

import functools

import bench_train
import jax
from bench_train import compare, patched

from dropless.models.deepseek_v3 import get_preset

original_init_state = bench_train.init_state


def init_state_reporting(model, config):
    state = original_init_state(model, config)
    adam = state.opt_state[1].inner_state[0]
    dtypes = sorted({str(m.dtype) for m in jax.tree.leaves((adam.mu, adam.nu))})
    print(f"== moments_dtype={config.moments_dtype}: moments stored as {dtypes}", flush=True)
    return state


def stored_as(dtype: str):
    bench = functools.partial(bench_train.bench, moments_dtype=dtype)
    return lambda: patched(bench_train, "bench", bench)


config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
with patched(bench_train, "init_state", init_state_reporting):
    compare(
        config,
        "pallas",
        {
            "float32 AdamW moments": stored_as("float32"),
            "bf16 AdamW moments": stored_as("bfloat16"),
        },
    )
