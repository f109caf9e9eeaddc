"""The unrolled proxy-2b train step (pallas, cuDNN attention, batch 8 x 2048) with its layers
inline two ways, in one process, each compiled afresh: the library's `unrolled_scan` (stacks
split by `split_layers`, whose backward writes the layers' gradients in place) and a fully
unrolled `jax.lax.scan` (before: XLA concatenates the layers' gradients). Prints each one's
median step, MFU, the last step's loss, and the wall time to its first step (trace, compile,
run). A measurement aid for the thirteenth and fourteenth runs (this copy: 8 timed steps), not
library code: `python bench_split.py` from experiments/."""

import sys
import time

import bench_train
import jax

from dropless.models.deepseek_v3 import get_preset, layers

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
library = layers.unrolled_scan
STEPS = 8
variants = {
    "split, in-place gradient slices (library)": library,
    "scan unrolled (before)": lambda body, x, xs: jax.lax.scan(body, x, xs, unroll=True),
}
for name in sys.argv[1:] or variants:
    jax.clear_caches()  # else a variant reuses the previous one's compiled step
    layers.unrolled_scan = variants[name]
    start = time.perf_counter()
    t, loss = bench_train.bench(config, "pallas", 8, 2048, STEPS)
    total = time.perf_counter() - start
    tokens_per_s = 8 * 2048 / t
    mfu = bench_train.flops_per_token(config, 2048) * tokens_per_s / 989e12
    print(
        f"== {name}: step {t:.4f} s, {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}, "
        f"loss {loss:.3f}, {total - (STEPS + 1) * t:.0f} s to the first step",
        flush=True,
    )
