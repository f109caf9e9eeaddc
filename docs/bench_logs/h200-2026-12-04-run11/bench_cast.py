"""The unrolled proxy-2b train step (pallas, cuDNN attention, batch 8 x 2048), three ways in one
process: as before (per-layer casts, the gradients materialised in float32 before the optimiser,
`step.materialized`); with the stacked matmul weights cast once up front and their gradients
stacked in bf16 behind a barrier (`layers.matmul_weights_cast`), keeping the float32 barrier;
and with the cast-up-front alone. A measurement aid for the eleventh run, not library code:
`python bench_cast.py` from experiments/."""

import bench_train
import jax

from dropless.models.deepseek_v3 import get_preset, layers
from dropless.train import step

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
cast, barrier = layers.matmul_weights_cast, step.materialized
plain_cast, no_barrier = (lambda arrays, dtype: arrays), (lambda tree: tree)
variants = {
    "per-layer casts, f32 barrier": (plain_cast, barrier),
    "cast up front + f32 barrier": (cast, barrier),
    "cast up front alone": (cast, no_barrier),
}
for name, (cast_fn, barrier_fn) in variants.items():
    jax.clear_caches()  # else a variant reuses the previous one's compiled step
    layers.matmul_weights_cast, step.materialized = cast_fn, barrier_fn
    t, loss = bench_train.bench(config, "pallas", 8, 2048, 5)
    tokens_per_s = 8 * 2048 / t
    mfu = bench_train.flops_per_token(config, 2048) * tokens_per_s / 989e12
    print(
        f"== {name}: step {t:.4f} s, {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}, loss {loss:.3f}",
        flush=True,
    )
