"""The unrolled proxy-2b train step (pallas, cuDNN attention, batch 8 x 2048) with two
cross-entropies in one process: optax's (the target's logit gathered, so its gradient scatters
into a float32 [batch seq vocab] buffer), as before; and the library's (picked by a one-hot
mask: the gradient is one elementwise expression). A measurement aid for the twelfth run, not
library code: `python bench_ce.py` from experiments/."""

import bench_train
import jax
import jax.numpy as jnp
import optax

from dropless.models.deepseek_v3 import get_preset
from dropless.train import step

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)


def optax_cross_entropy(logits, targets, mask=None):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if mask is None:
        return ce.mean()
    return jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(mask.sum(), 1)


variants = {
    "optax cross-entropy (before)": optax_cross_entropy,
    "one-hot mask (library)": step._cross_entropy,
}
for name, cross_entropy in variants.items():
    jax.clear_caches()  # else a variant reuses the previous one's compiled step
    step._cross_entropy = cross_entropy
    t, loss = bench_train.bench(config, "pallas", 8, 2048, 5)
    tokens_per_s = 8 * 2048 / t
    mfu = bench_train.flops_per_token(config, 2048) * tokens_per_s / 989e12
    print(
        f"== {name}: step {t:.4f} s, {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}, loss {loss:.3f}",
        flush=True,
    )
