"""The unrolled proxy-2b step (pallas, cuDNN; batch: the first argument, 24 if none): float32
logits with the library's one-pass loss, then bfloat16 logits with the one-pass loss and with
the two variants of bench_cross_entropy_run20.py (one exponential per combine; the maximum
first, then one sum), swapped in for the loss's forward (the backward is the library's). As
run (library of f94bb71), "one pass" was the two-exponential combiner; the library's one pass
now is the one-exponential one. One process; the second argument says which variants run
(all if none, else comma-separated keys: f32, bf16, one_exp, two_passes). Run from
experiments/ with it on PYTHONPATH (twentieth run)."""

import contextlib
import dataclasses
import importlib
import sys

import bench_cross_entropy_run20 as variants
from bench_train import compare

from dropless.models.deepseek_v3 import get_preset

# The module (dropless.train's `cross_entropy` is the function of the same name).
ce = importlib.import_module("dropless.train.cross_entropy")


@contextlib.contextmanager
def loss_forward(forward):
    """The loss's forward replaced, as `token_cross_entropy.defvjp` would, restored after."""
    saved = ce.token_cross_entropy.fwd, ce._forward
    ce.token_cross_entropy.fwd, ce._forward = forward, forward
    try:
        yield
    finally:
        ce.token_cross_entropy.fwd, ce._forward = saved


batch = int(sys.argv[1]) if len(sys.argv) > 1 else 24
chosen = sys.argv[2].split(",") if len(sys.argv) > 2 else ["f32", "bf16", "one_exp", "two_passes"]
proxy = get_preset("proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn")
bf16 = dataclasses.replace(proxy, logits_dtype="bfloat16")
runs = {
    "f32": (proxy, "float32 logits, one pass", {}),
    "bf16": (bf16, "bfloat16 logits, one pass", {}),
    "one_exp": (
        bf16,
        "bfloat16 logits, one pass with one exp",
        lambda: loss_forward(variants.VARIANTS["one pass, one exp"].fwd),
    ),
    "two_passes": (
        bf16,
        "bfloat16 logits, two passes",
        lambda: loss_forward(variants.VARIANTS["two passes"].fwd),
    ),
}
for key in chosen:
    config, name, variant = runs[key]
    compare(config, "pallas", {name: variant}, batch=batch)
