"""The unrolled proxy-2b step (pallas, cuDNN) with the one-pass cross-entropy against the
chunked head and loss (`loss_chunk`), in one process: batch 24 with no chunks, 8192 and 4096
positions a chunk; then batch 32 in one pass with 8192-position chunks, which the one-pass loss
did not fit (an out-of-memory error is printed, not raised). Run from experiments/ with it on
PYTHONPATH; the first argument lists the batches (default "24,32")."""

import sys

from bench_train import compare, out_of_gpu_memory

from dropless.models.deepseek_v3 import get_preset

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "24,32").split(",")]
proxy = get_preset("proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn")
variants = {
    24: {
        "one pass": {},
        "loss_chunk=8192": {"set": ["loss_chunk=8192"]},
        "loss_chunk=4096": {"set": ["loss_chunk=4096"]},
    },
    32: {"loss_chunk=8192, batch 32": {"set": ["loss_chunk=8192"]}},
}
for batch in batches:
    for name, variant in variants[batch].items():
        try:
            compare(proxy, "pallas", {name: variant}, batch=batch)
        except Exception as err:  # noqa: BLE001 -- report and go on
            print(
                f"== {name}: {'out of memory' if out_of_gpu_memory(err) else 'error'}: "
                f"{str(err)[:300]}",
                flush=True,
            )
