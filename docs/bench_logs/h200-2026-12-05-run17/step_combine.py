"""The batch-24 proxy-2b step with the combine's weights gradient by token (as before) and by
row of the sorted buffer (dropless.backends.jnp._weights_grad_by_row, the GPU's form now), in
one process. Run from experiments/ with it on PYTHONPATH."""

import contextlib

from bench_train import compare, patched

import dropless.backends.jnp as jnp_backend
from dropless.models.deepseek_v3 import get_preset


def by_token():
    return patched(jnp_backend, "_weights_grad", jnp_backend._weights_grad_by_token)


config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
compare(
    config,
    "pallas",
    {"by token (before)": by_token, "by row (now)": contextlib.nullcontext},
    batch=24,
)
