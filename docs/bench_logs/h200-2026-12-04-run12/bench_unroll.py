"""The unrolled proxy-2b train step (pallas, cuDNN attention, batch 8 x 2048), four ways of
building the stacked gradients in one process: the fully unrolled `jax.lax.scan` (before:
XLA concatenates the layers' gradients in one fused kernel); the layers split by
`layers.split_layers`, whose backward stacks them with `jnp.stack` (the library); the same with
the layers' gradients flattened before one 1-D concatenation; and written one by one into a
zero stack with `dynamic_update_slice`. A measurement aid for the twelfth run, not library
code: `python bench_unroll.py` from experiments/."""

import sys

import bench_train
import jax
import jax.numpy as jnp

from dropless.models.deepseek_v3 import get_preset, layers

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)


def scan_unrolled(body, x, arrays):
    return jax.lax.scan(body, x, arrays, unroll=True)


def flat_concat(parts):
    return jnp.concatenate([p.reshape(-1) for p in parts]).reshape((len(parts), *parts[0].shape))


def update_slices(parts):
    out = jnp.zeros((len(parts), *parts[0].shape), parts[0].dtype)
    for i, p in enumerate(parts):
        out = jax.lax.dynamic_update_index_in_dim(out, p, i, 0)
    return out


library = layers.unrolled, layers.stack_cotangents
variants = {
    "scan unrolled (before)": (scan_unrolled, library[1]),
    "split, jnp.stack (library)": library,
    "split, flat concatenation": (library[0], flat_concat),
    "split, dynamic_update_slice": (library[0], update_slices),
}
for name in sys.argv[1:] or variants:
    jax.clear_caches()  # else a variant reuses the previous one's compiled step
    layers.unrolled, layers.stack_cotangents = variants[name]
    t, loss = bench_train.bench(config, "pallas", 8, 2048, 5)
    tokens_per_s = 8 * 2048 / t
    mfu = bench_train.flops_per_token(config, 2048) * tokens_per_s / 989e12
    print(
        f"== {name}: step {t:.4f} s, {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}, loss {loss:.3f}",
        flush=True,
    )
