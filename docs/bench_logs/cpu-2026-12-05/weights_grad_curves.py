"""Does the routing weights' gradient by row (the GPU's form) train like the one by token (the
CPU's)? Both sum the same float32 products in another order. Trains the tiny preset twice on the
CPU from the same seed and data, once with each form, and prints how far the two loss curves and
the final evaluations are apart; draws both curves.

    python docs/bench_logs/cpu-2026-12-05/weights_grad_curves.py [--steps 400]
        [--compute-dtype float32|bfloat16] [--out DIR]
"""

import argparse
import contextlib
import json
import pathlib
import tempfile

import jax
import numpy as np

import dropless.backends.jnp as jnp_backend
from dropless.models.deepseek_v3 import get_preset
from dropless.train import TrainConfig, train


@contextlib.contextmanager
def weights_grad(form):
    saved = jnp_backend._weights_grad
    jnp_backend._weights_grad = form
    try:
        yield
    finally:
        jnp_backend._weights_grad = saved


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--compute-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent)
    args = parser.parse_args()
    forms = {
        "by token": jnp_backend._weights_grad_by_token,
        "by row": jnp_backend._weights_grad_by_row,
    }
    curves, evals = {}, {}
    for name, form in forms.items():
        jax.clear_caches()  # else the second run reuses the first one's traced train step
        with weights_grad(form), tempfile.TemporaryDirectory() as out_dir:
            model = get_preset("tiny", compute_dtype=args.compute_dtype)
            results = train(model, TrainConfig(steps=args.steps), out_dir=out_dir)
        curves[name] = np.asarray(results.losses)
        evals[name] = results.final_eval["loss"]
    a, b = curves.values()
    gap = np.abs(a - b)
    summary = {
        "steps": args.steps,
        "compute dtype": args.compute_dtype,
        "final train loss": {k: float(v[-1]) for k, v in curves.items()},
        "final eval loss": evals,
        "first step where the curves differ": int(np.argmax(gap > 0)) if gap.any() else None,
        "largest |difference| of a step's loss": float(gap.max()),
        "mean |difference| over the last 100 steps": float(gap[-100:].mean()),
        "mean step-to-step |change| of 'by token' over the last 100 steps": float(
            np.abs(np.diff(a[-101:])).mean()
        ),
    }
    print(json.dumps(summary, indent=1))
    stem = f"weights_grad_curves_{args.compute_dtype}"
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for name, curve in curves.items():
        top.plot(curve, label=name, lw=0.8)
    top.set_ylabel("train loss")
    top.legend()
    bottom.plot(b - a, lw=0.8, color="k")
    bottom.set_ylabel("by row - by token")
    bottom.set_xlabel("step")
    fig.suptitle(
        f"tiny preset on the CPU, {args.compute_dtype}: routing weights' gradient by token "
        "and by row",
        size=9,
    )
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=110)


if __name__ == "__main__":
    main()
