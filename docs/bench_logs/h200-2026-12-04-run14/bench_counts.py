"""Counting the copies per expert on the GPU, both ways of `balance.expert_counts` (a
scatter-add bincount, and ids compared with every expert and summed): kernel time (CUPTI) at
proxy-2b's routing (16384 tokens x top-6 into 64 experts) and DeepSeek-V3's (x top-8 into 256);
then the proxy-2b train step (pallas, cuDNN attention, batch 8 x 2048, layers unrolled) with
each as the library's default, one process, each compiled afresh. A measurement aid for the
fourteenth run, not library code: `python bench_counts.py` from experiments/."""

import functools
import sys
import time

import bench_train
import jax
from _timing import kernel_time

from dropless import balance
from dropless.backends import jnp as jnp_backend
from dropless.models.deepseek_v3 import get_preset

library = balance.expert_counts
for experts, k in ((64, 6), (256, 8)):
    ids = jax.random.randint(jax.random.key(0), (16384, k), 0, experts)
    times = {}
    for method in ("scatter", "compare") * 2:
        count = jax.jit(functools.partial(library, n_experts=experts, method=method))
        times.setdefault(method, []).append(kernel_time(count, ids))
    print(
        f"== count 16384 x {k} into {experts}: "
        + ", ".join(f"{m} {min(t) * 1e6:.1f} us" for m, t in times.items()),
        flush=True,
    )

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
STEPS = 8
for method in sys.argv[1:] or ("compare", "scatter"):
    jax.clear_caches()
    patched = functools.partial(library, method=method)
    balance.expert_counts = jnp_backend.expert_counts = patched
    start = time.perf_counter()
    t, loss = bench_train.bench(config, "pallas", 8, 2048, STEPS)
    total = time.perf_counter() - start
    mfu = bench_train.flops_per_token(config, 2048) * 8 * 2048 / t / 989e12
    print(
        f"== step, counts by {method}: {t:.4f} s, MFU {mfu:.1%}, loss {loss:.3f}, "
        f"{total - (STEPS + 1) * t:.0f} s to the first step",
        flush=True,
    )
