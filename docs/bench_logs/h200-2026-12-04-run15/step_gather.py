"""The proxy-2b batch-8 step (pallas, cuDNN attention, layers unrolled) with the dispatch's row
gathers as uint32 words (library since f36075d) and as plain x[index] (before), one process.
A measurement aid for the fifteenth run, not library code; run from experiments/."""

import contextlib

from bench_train import compare, patched

from dropless.backends import jnp as jnp_backend
from dropless.models.deepseek_v3 import get_preset

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
compare(
    config,
    "pallas",
    {
        "word-view gathers (library)": contextlib.nullcontext,
        "x[index] gathers (before)": lambda: patched(
            jnp_backend, "_gather_as_words", jnp_backend._gather_plain
        ),
    },
)
