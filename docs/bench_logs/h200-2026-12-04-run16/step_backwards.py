"""The proxy-2b step (pallas, cuDNN attention, layers unrolled) at batch 16 with RMSNorm,
SwiGLU and the cross-entropy differentiated by JAX (as before 2026-12-04's sixteenth run) and
with their hand-written backwards ("now": the library at d78f5a4; the RMSNorm and SwiGLU ones
were taken out in fb5c263, so this runs at d78f5a4); one process. A measurement aid for the
sixteenth run, not library code; run from experiments/ (or with it on PYTHONPATH):

    python step_backwards.py BATCH [now-first]"""

import contextlib
import sys

import jax
import jax.numpy as jnp
from bench_train import compare, patched

import dropless.experts
import dropless.nn.mlp
import dropless.nn.rmsnorm
import dropless.train.step
from dropless.models.deepseek_v3 import get_preset


def autodiff_rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * normed).astype(x.dtype)


def autodiff_swiglu(gate_and_up):
    gate, up = jnp.split(gate_and_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def autodiff_cross_entropy(logits, targets, mask=None):
    logits = logits.astype(jnp.float32)
    is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
    target_logits = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
    ce = jax.nn.logsumexp(logits, axis=-1) - target_logits
    if mask is None:
        return ce.mean()
    return jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(mask.sum(), 1)


@contextlib.contextmanager
def autodiff_backwards():
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(dropless.nn.rmsnorm, "rms_norm", autodiff_rms_norm))
        stack.enter_context(patched(dropless.nn.mlp, "swiglu", autodiff_swiglu))
        stack.enter_context(patched(dropless.experts, "swiglu", autodiff_swiglu))
        stack.enter_context(patched(dropless.train.step, "cross_entropy", autodiff_cross_entropy))
        yield


if __name__ == "__main__":
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    variants = {
        "autodiff backwards (before)": autodiff_backwards,
        "hand-written (now)": contextlib.nullcontext,
    }
    if "now-first" in sys.argv:  # so that a variant that runs out of memory ends the script last
        variants = dict(reversed(variants.items()))
    config = get_preset(
        "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
    )
    compare(config, "pallas", variants, batch=batch)
