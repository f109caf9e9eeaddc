"""The unrolled proxy-2b step (pallas, cuDNN; batch: the first argument, 24 if none) with the
head writing float32 logits (the default) and bfloat16 logits (`logits_dtype="bfloat16"`; the
loss reduces in float32 either way), alternated in one process, as many rounds as the second
argument says (2 if none). Run from experiments/ (twentieth run)
with it on PYTHONPATH."""

import sys

from bench_train import compare

from dropless.models.deepseek_v3 import get_preset

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 24
proxy = get_preset("proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
for round_ in range(1, rounds + 1):
    compare(
        proxy,
        "pallas",
        {
            f"float32 logits ({round_})": {},
            f"bfloat16 logits ({round_})": {"set": ["logits_dtype=bfloat16"]},
        },
        batch=batch,
    )
