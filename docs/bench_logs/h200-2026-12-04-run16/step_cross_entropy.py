"""The proxy-2b step (pallas, cuDNN attention, layers unrolled) at batch 24 with the
cross-entropy differentiated by JAX (two passes for logsumexp, one for the target's logit) and
with its hand-written one-pass forward and backward (now); one process. A measurement aid for
the sixteenth run, not library code; run from experiments/ (or with it on PYTHONPATH)."""

import contextlib

from bench_train import compare, patched
from step_backwards import autodiff_cross_entropy

import dropless.train.step
from dropless.models.deepseek_v3 import get_preset

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
variants = {
    "cross-entropy by autodiff (before)": lambda: patched(
        dropless.train.step, "cross_entropy", autodiff_cross_entropy
    ),
    "one-pass cross-entropy (now)": contextlib.nullcontext,
}
compare(config, "pallas", variants, batch=24)
