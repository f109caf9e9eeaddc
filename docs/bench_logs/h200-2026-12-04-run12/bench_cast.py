"""The unrolled proxy-2b train step (pallas, cuDNN attention, batch 8 x 2048) two ways in one
process: the stacked matmul weights cast per layer, their float32 gradients stacked behind a
barrier (`matmul_weights_cast` with their own dtype, as under remat: the closest to the code
before the change, which put every gradient through one float32 barrier); and as the library
runs it now, cast once up front, the gradients stacked in bf16 behind the barrier. A
measurement aid for the twelfth run, not library code: `python bench_cast.py` from
experiments/."""

import bench_train
import jax

from dropless.models.deepseek_v3 import get_preset, layers

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
cast_up_front = layers.matmul_weights_cast
variants = {
    "per-layer casts, f32 gradient barrier": lambda arrays, dtype=None: cast_up_front(arrays),
    "cast up front, bf16 gradient barrier (library)": cast_up_front,
}
for name, cast_fn in variants.items():
    jax.clear_caches()  # else a variant reuses the previous one's compiled step
    layers.matmul_weights_cast = cast_fn
    t, loss = bench_train.bench(config, "pallas", 8, 2048, 5)
    tokens_per_s = 8 * 2048 / t
    mfu = bench_train.flops_per_token(config, 2048) * tokens_per_s / 989e12
    print(
        f"== {name}: step {t:.4f} s, {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}, loss {loss:.3f}",
        flush=True,
    )
