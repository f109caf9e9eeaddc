"""The proxy-2b train step with the layers unrolled, profiled twice in one process: as the
library runs it (gradients materialised before the optimiser, `step.materialized`) and with
that barrier taken out (the code before it). A measurement aid for the tenth run, not library
code: `python bench_barrier.py` from experiments/."""

import pathlib

import bench_train
import jax

from dropless.models.deepseek_v3 import get_preset
from dropless.train import step

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
with_barrier = step.materialized
for name, fn in (("barrier", with_barrier), ("no barrier", lambda tree: tree)):
    jax.clear_caches()  # else the second variant reuses the first one's compiled step
    step.materialized = fn
    out = pathlib.Path("/tmp/barrier") / name.replace(" ", "_")
    t, loss = bench_train.bench(config, "pallas", 8, 2048, 3, out, 12)
    tokens_per_s = 8 * 2048 / t
    mfu = bench_train.flops_per_token(config, 2048) * tokens_per_s / 989e12
    print(
        f"== {name}: step {t:.4f} s, {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}, loss {loss:.3f}"
    )
