"""experiments/bench_cross_entropy.py as call B of the twentieth run ran it (b1 log), with the
library of f94bb71: "library (one pass)" was then the one pass whose combiner takes two
exponentials (written out here, `_one_pass_two_exps`, since the library has since moved to
"one pass, one exp"). step_loss_reduction.py takes its variants from here.

    python bench_cross_entropy_run20.py [--positions 49152] [--vocab 32768]   (from experiments/)
"""

import argparse

import jax
import jax.numpy as jnp

from dropless.train.cross_entropy import _backward, _is_target

F32 = jnp.float32


def _two_exp_combine(a, b):
    (max_a, sum_a, target_a), (max_b, sum_b, target_b) = a, b
    top = jnp.maximum(max_a, max_b)
    rescaled = sum_a * jnp.exp(max_a - top) + sum_b * jnp.exp(max_b - top)
    return top, rescaled, target_a + target_b


def _one_exp_combine(a, b):
    (max_a, sum_a, target_a), (max_b, sum_b, target_b) = a, b
    a_on_top = max_a >= max_b
    scale = jnp.exp(-jnp.abs(max_a - max_b))  # exp(smaller max - larger max)
    total = jnp.where(a_on_top, sum_a + sum_b * scale, sum_a * scale + sum_b)
    return jnp.maximum(max_a, max_b), total, target_a + target_b


def _one_pass(combine):
    def forward(logits, targets):
        wide = logits.astype(F32)
        picked = jnp.where(_is_target(logits, targets), wide, 0.0)
        init = (F32(jnp.finfo(F32).min), F32(0), F32(0))
        top, total, target_logits = jax.lax.reduce(
            (wide, jnp.ones_like(wide), picked), init, combine, (logits.ndim - 1,)
        )
        lse = top + jnp.log(total)
        return lse - target_logits, (logits, targets, lse)

    return forward


_one_pass_two_exps = _one_pass(_two_exp_combine)
_one_pass_one_exp = _one_pass(_one_exp_combine)


def _two_passes(logits, targets):
    wide = logits.astype(F32)
    top = jax.lax.stop_gradient(jnp.max(wide, axis=-1))
    total = jnp.sum(jnp.exp(wide - top[..., None]), axis=-1)
    target_logits = jnp.sum(jnp.where(_is_target(logits, targets), wide, 0.0), -1)
    lse = top + jnp.log(total)
    return lse - target_logits, (logits, targets, lse)


def _with_library_backward(forward):
    @jax.custom_vjp
    def loss(logits, targets):
        return forward(logits, targets)[0]

    loss.defvjp(forward, _backward)
    return loss


VARIANTS = {
    "library (one pass)": _with_library_backward(_one_pass_two_exps),
    "one pass, one exp": _with_library_backward(_one_pass_one_exp),
    "two passes": _with_library_backward(_two_passes),
}


def measure(positions: int, vocab: int, dtypes: list[str]) -> list[dict]:
    from _timing import kernel_time, median_time

    timed = kernel_time if jax.default_backend() == "gpu" else median_time
    rows = []
    for dtype in dtypes:
        k_logits, k_targets = jax.random.split(jax.random.key(0))
        logits = (4 * jax.random.normal(k_logits, (positions, vocab))).astype(dtype)
        targets = jax.random.randint(k_targets, (positions,), 0, vocab)
        read = timed(jax.jit(lambda x: jnp.sum(x.astype(F32))), logits)
        base = jax.jit(VARIANTS["library (one pass)"])(logits, targets)
        times = {}
        for name, fn in VARIANTS.items():
            fwd = jax.jit(fn)
            both = jax.jit(jax.value_and_grad(lambda x, t, fn=fn: jnp.mean(fn(x, t))))
            times[name] = (timed(fwd, logits, targets), timed(both, logits, targets))
            diff = float(jnp.max(jnp.abs(fwd(logits, targets) - base)))
            lib_fwd, lib_both = times["library (one pass)"]
            rows.append(
                {
                    "dtype": dtype,
                    "variant": name,
                    "fwd ms": 1e3 * times[name][0],
                    "fwd+bwd ms": 1e3 * times[name][1],
                    "fwd / one read": times[name][0] / read,
                    "fwd / library": times[name][0] / lib_fwd,
                    "fwd+bwd / library": times[name][1] / lib_both,
                    "max |diff|": diff,
                    "one read ms": 1e3 * read,
                }
            )
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--positions", type=int, default=49152)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtypes", default="bfloat16,float32")
    args = p.parse_args()
    from _timing import machine, print_table

    rows = measure(args.positions, args.vocab, args.dtypes.split(","))
    print_table(rows, f"cross-entropy over [{args.positions} {args.vocab}] logits, {machine()}")
