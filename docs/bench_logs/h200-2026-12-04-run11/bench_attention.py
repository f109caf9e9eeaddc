"""The unrolled proxy-2b train step (pallas, cuDNN attention, batch 8 x 2048) profiled twice in
one process: with MLA's value heads at their own width (`cudnn_attention`, the library's
default) and zero-padded to the query/key width (the code before it). A measurement aid for
the eleventh run, not library code: `python bench_attention.py` from experiments/."""

import functools
import pathlib

import bench_train
import jax

from dropless.models.deepseek_v3 import get_preset
from dropless.nn import mla

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
as_they_are = mla.cudnn_attention
padded = functools.partial(as_they_are, mla_widths=False)
for name, fn in (("mla widths", as_they_are), ("padded", padded)):
    jax.clear_caches()  # else the second variant reuses the first one's compiled step
    mla.cudnn_attention = fn
    out = pathlib.Path("/tmp/attention") / name.replace(" ", "_")
    t, loss = bench_train.bench(config, "pallas", 8, 2048, 3, out, 400)
    tokens_per_s = 8 * 2048 / t
    mfu = bench_train.flops_per_token(config, 2048) * tokens_per_s / 989e12
    print(
        f"== {name}: step {t:.4f} s, {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}, loss {loss:.3f}"
    )
