"""The gradient's global norm over proxy-2b's trainable leaves (float32, unrolled layers, about
2.08B numbers, 8.3 GB): optax's tree norm, as the step computes it for clipping and the metric,
against other formulations of the same sum of squares, with the time to read the bytes once
at the measured copy bandwidth for scale. Run from experiments/ with it on PYTHONPATH."""

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _timing import kernel_time, median_time, print_table

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import optim

config = get_preset(sys.argv[1] if len(sys.argv) > 1 else "proxy-2b", unroll_layers=True)
shapes = eqx.filter_eval_shape(lambda: DeepSeekV3(config, backend="jnp", key=jax.random.key(0)))
model = jax.tree.map(
    lambda s: jnp.full(s.shape, 1e-3, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s, shapes
)
leaves = jax.tree.leaves(eqx.filter(model, optim.trainable_filter(model)))
del model
numbers = sum(x.size for x in leaves)
print(f"{len(leaves)} leaves, {numbers / 1e9:.3f}B numbers, {4 * numbers / 1e9:.2f} GB")


def by_rows(tree):  # each leaf as [rows, 128] (zero-padded), squares summed over rows first
    def sq(x):
        flat = x.reshape(-1)
        flat = jnp.pad(flat, (0, -flat.size % 128)).reshape(-1, 128)
        return jnp.sum(jnp.sum(flat * flat, axis=0))

    return jnp.sqrt(sum(sq(x) for x in jax.tree.leaves(tree)))


def by_vdot(tree):
    return jnp.sqrt(sum(jnp.vdot(x.reshape(-1), x.reshape(-1)) for x in jax.tree.leaves(tree)))


def one_concat(tree):  # what a single reduction over all the bytes would take, after a copy
    flat = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(tree)])
    return jnp.sqrt(jnp.sum(flat * flat))


timer = kernel_time if jax.default_backend() == "gpu" else median_time
rows = []
for name, fn in {
    "optax.tree.norm (the step's)": optax.tree.norm,
    "rows of 128, then sum": by_rows,
    "vdot per leaf": by_vdot,
    "concatenated, one sum": one_concat,
    "copy of every leaf (x + 1)": lambda t: jax.tree.map(lambda x: x + 1, t),
}.items():
    t = timer(jax.jit(fn), leaves)
    rows.append({"variant": name, "ms": 1e3 * t, "GB/s read": 4 * numbers / t / 1e9})
    print_table(rows[-1:])
print_table(rows, "global norm of proxy-2b's float32 gradient")
