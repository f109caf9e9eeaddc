"""experiments/bench_cross_entropy.py as call B of the twentieth run ran it (b1 log), with the
library of f94bb71: "library (one pass)" was then the one pass whose combiner takes two
exponentials (written out here, `_one_pass_two_exps`, since the library has since moved to
"one pass, one exp"). step_loss_reduction.py takes its variants from here.

    python bench_cross_entropy_run20.py [--positions 49152] [--vocab 32768]   (from experiments/)

Since then its table comes from experiments/bench_cross_entropy.py (the same measurement, with
the ratio columns named "fwd / library (one pass)" where the log says "fwd / library").
"""

import jax.numpy as jnp
from bench_cross_entropy import _two_exp_combine, loss_with, main, one_pass_with

from dropless.train.cross_entropy import _logsumexp_two_passes


def _one_exp_combine(a, b):
    """The one-exponential combiner as it ran (the library's adds a guard for equal maxima)."""
    (max_a, sum_a, target_a), (max_b, sum_b, target_b) = a, b
    scale = jnp.exp(-jnp.abs(max_a - max_b))  # exp(smaller max - larger max)
    total = jnp.where(max_a >= max_b, sum_a + sum_b * scale, sum_a * scale + sum_b)
    return jnp.maximum(max_a, max_b), total, target_a + target_b


_one_pass_two_exps = one_pass_with(_two_exp_combine)
_one_pass_one_exp = one_pass_with(_one_exp_combine)
# step_loss_reduction.py swaps their forwards (`.fwd`) in for the library's.
VARIANTS = {
    "library (one pass)": loss_with(_one_pass_two_exps),
    "one pass, one exp": loss_with(_one_pass_one_exp),
    "two passes": loss_with(_logsumexp_two_passes),
}

if __name__ == "__main__":
    main(variants=VARIANTS, base="library (one pass)")
