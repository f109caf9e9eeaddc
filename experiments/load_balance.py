"""Load balancing: none vs batch aux loss vs sequence-wise aux loss vs aux-loss-free expert bias
(vs bias + the small sequence-wise loss DeepSeek-V3 uses), same model, data and seed.

    python experiments/load_balance.py [--size tiny|small] [--steps N] [--aux C] [--rate R]
        [--data synthetic|stdlib|DIR]

Each variant is one `dropless.train.train` run on the built-in synthetic corpus, or with
`--data` on real text (the model's vocabulary then the tokenizer's). Reported per
variant: cross-entropy (train, mean of the last 10% of steps; held-out at the end) and MaxVio
(max over experts of load / mean load - 1, averaged over MoE layers incl. MTP) over training.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    add_data_option,
    fit_to_data,
    machine,
    model_config,
    parser,
    print_table,
    smoothed,
    train_config,
    write_results,
)

from dropless.train import train  # noqa: E402


def variants(aux: float, rate: float) -> dict[str, dict]:
    off = dict(balance_loss_coef=0.0, seq_balance_loss_coef=0.0, bias_update_rate=0.0)
    return {
        "none": off,
        "batch_aux": {**off, "balance_loss_coef": aux},
        "seq_aux": {**off, "seq_balance_loss_coef": aux},
        "bias": {**off, "bias_update_rate": rate},
        "bias+seq": {**off, "bias_update_rate": rate, "seq_balance_loss_coef": 1e-4},
    }


def main(argv=None) -> list[dict]:
    p = parser("load_balance", __doc__, steps=150)
    p.add_argument("--aux", type=float, default=1e-2, help="aux loss coefficient (batch/seq)")
    p.add_argument("--rate", type=float, default=1e-2, help="expert-bias update rate")
    p.add_argument(
        "--only", nargs="*", default=None, choices=list(variants(0, 0)), help="run only these"
    )
    add_data_option(p)
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    mc = fit_to_data(model_config(args), train_config(args))
    rows, curves = [], {}
    for name, changes in variants(args.aux, args.rate).items():
        if args.only and name not in args.only:
            continue
        res = train(mc, train_config(args, **changes), backend="jnp", out_dir=str(out / name))
        rec = res.records
        tail = rec[-max(1, len(rec) // 10) :]
        curves[name] = dict(
            ce=[r["ce"] for r in rec],
            max_vio=[r["max_vio"] for r in rec],
        )
        rows.append(
            dict(
                variant=name,
                **{k: v for k, v in changes.items() if v},
                ce_last10pct=float(np.mean([r["ce"] for r in tail])),
                eval_ce=float(res.final_eval["ce"]),
                max_vio_last10pct=float(np.mean([r["max_vio"] for r in tail])),
                max_vio_mean=float(np.mean([r["max_vio"] for r in rec])),
                step_ms=1e3 * float(np.median([r["step_time"] for r in rec[1:]] or [0.0])),
            )
        )
    meta = dict(machine=machine(), size=args.size, steps=args.steps, aux=args.aux, rate=args.rate)
    meta["data"] = args.data
    write_results(out, "load_balance", rows, {**meta, "curves": curves})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    window = max(1, args.steps // 20)
    for name, c in curves.items():
        axes[0].plot(*smoothed(c["ce"], window), label=name)
        axes[1].plot(*smoothed(c["max_vio"], window), label=name)
    axes[0].set(xlabel="step", ylabel="train cross-entropy (nats)", title="loss")
    axes[1].set(xlabel="step", ylabel="MaxVio (mean over MoE layers)", title="imbalance")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.legend()
    fig.suptitle(f"{args.size} on {args.data} data, {args.steps} steps, smoothed over {window}")
    fig.tight_layout()
    fig.savefig(out / "load_balance.png", dpi=80)
    plt.close(fig)
    print_table(rows, f"load balancing ({meta['machine']})")
    return rows


if __name__ == "__main__":
    main()
