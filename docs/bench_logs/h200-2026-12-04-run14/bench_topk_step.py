"""The proxy-2b train step (pallas, cuDNN attention, batch 8 x 2048, layers unrolled) with
routing's top-k as the library's k rounds of argmax and as `jax.lax.top_k` (before), one
process, each compiled afresh. A measurement aid for the fourteenth run, not library code:
`python bench_topk_step.py` from experiments/."""

import sys
import time

import bench_train
import jax

from dropless import routing
from dropless.models.deepseek_v3 import get_preset

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
variants = {
    "argmax rounds (library)": routing._top_k,
    "lax.top_k (before)": lambda values, k: jax.lax.top_k(values, k)[1],
}
STEPS = 8
for name in sys.argv[1:] or variants:
    jax.clear_caches()
    routing._top_k = variants[name]
    start = time.perf_counter()
    t, loss = bench_train.bench(config, "pallas", 8, 2048, STEPS)
    total = time.perf_counter() - start
    mfu = bench_train.flops_per_token(config, 2048) * 8 * 2048 / t / 989e12
    print(
        f"== step, top-k by {name}: {t:.4f} s, MFU {mfu:.1%}, loss {loss:.3f}, "
        f"{total - (STEPS + 1) * t:.0f} s to the first step",
        flush=True,
    )
