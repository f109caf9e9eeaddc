"""The loss's reduction over the logits, each way the library has, on a GPU (kernel time) or
anywhere (wall time).

    python benchmarks/bench_cross_entropy.py [--positions 49152] [--vocab 32768] [--out results]

`token_cross_entropy` picks its forward by platform (`jax.lax.platform_dependent`):

- "one pass" (GPUs): one reduction per row carrying (running maximum, rescaled sum of
  exponentials, target logit), its combiner taking one exponential;
- "two passes" (the CPU): the maximum, then the sum of exp(x - max) and the target's logit;
- "one pass, two exps" (the library's earlier forward, for comparison: 18-21% slower on an
  H100): the one pass with a combiner that rescales both sums, two exponentials.

Each runs with the library's backward (softmax minus one-hot, from the saved logsumexp). The
reference is one plain read of the logits (their float32 sum), the least any of them can cost.
Prints, per dtype, each variant's forward and forward+backward time, over that read and over
the one pass, and its largest difference from the one pass's losses.
"""

import argparse
import functools
import pathlib

import jax
import jax.numpy as jnp

# Times the private passes of the fused cross-entropy against each other, not only its API.
from dropless.train.step._cross_entropy import (
    _backward,
    _logsumexp_one_pass,
    _logsumexp_two_passes,
)

F32 = jnp.float32


def _two_exp_combine(a, b):
    (max_a, sum_a, target_a), (max_b, sum_b, target_b) = a, b
    top = jnp.maximum(max_a, max_b)
    rescaled = sum_a * jnp.exp(max_a - top) + sum_b * jnp.exp(max_b - top)
    return top, rescaled, target_a + target_b


def one_pass_with(combine):
    """(logsumexp, target logit) in the library's one pass, under another combiner."""
    return functools.partial(_logsumexp_one_pass, combine=combine)


def loss_with(logsumexp_and_target):
    """A cross-entropy with this forward reduction and the library's backward."""

    def forward(logits, targets):
        lse, target_logits = logsumexp_and_target(logits, targets)
        return lse - target_logits, (logits, targets, lse)

    @jax.custom_vjp
    def loss(logits, targets):
        return forward(logits, targets)[0]

    loss.defvjp(forward, _backward)
    return loss


VARIANTS = {
    "one pass": loss_with(_logsumexp_one_pass),
    "two passes": loss_with(_logsumexp_two_passes),
    "one pass, two exps": loss_with(one_pass_with(_two_exp_combine)),
}


def measure(
    positions: int, vocab: int, dtypes: list[str], variants=VARIANTS, base: str = "one pass"
) -> list[dict]:
    """A row per (dtype, variant) of `variants` (name: loss function), ratios over `base`."""
    from _timing import kernel_time, median_time

    timed = kernel_time if jax.default_backend() == "gpu" else median_time
    rows = []
    for dtype in dtypes:
        k_logits, k_targets = jax.random.split(jax.random.key(0))
        logits = (4 * jax.random.normal(k_logits, (positions, vocab))).astype(dtype)
        targets = jax.random.randint(k_targets, (positions,), 0, vocab)
        read = timed(jax.jit(lambda x: jnp.sum(x.astype(F32))), logits)
        reference = jax.jit(variants[base])(logits, targets)
        times, diffs = {}, {}
        for name, fn in variants.items():
            fwd = jax.jit(fn)
            both = jax.jit(jax.value_and_grad(lambda x, t, fn=fn: jnp.mean(fn(x, t))))
            times[name] = (timed(fwd, logits, targets), timed(both, logits, targets))
            diffs[name] = float(jnp.max(jnp.abs(fwd(logits, targets) - reference)))
        base_fwd, base_both = times[base]
        for name, (fwd_s, both_s) in times.items():
            rows.append(
                {
                    "dtype": dtype,
                    "variant": name,
                    "fwd ms": 1e3 * fwd_s,
                    "fwd+bwd ms": 1e3 * both_s,
                    "fwd / one read": fwd_s / read,
                    f"fwd / {base}": fwd_s / base_fwd,
                    f"fwd+bwd / {base}": both_s / base_both,
                    "max |diff|": diffs[name],
                    "one read ms": 1e3 * read,
                }
            )
    return rows


def main(argv=None, variants=VARIANTS, base: str = "one pass") -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--positions", type=int, default=49152)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    args = p.parse_args(argv)
    from _timing import machine, print_table, write_results

    rows = measure(args.positions, args.vocab, args.dtypes.split(","), variants, base)
    print_table(rows, f"cross-entropy over [{args.positions} {args.vocab}] logits, {machine()}")
    meta = {"machine": machine(), "positions": args.positions, "vocab": args.vocab}
    write_results(args.out, "cross_entropy", rows, meta)
    return rows


if __name__ == "__main__":
    main()
