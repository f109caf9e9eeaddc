"""Model families side by side: the tiny preset of each family (DeepSeek-V3, Qwen3-MoE,
Mixtral, OLMoE, gpt-oss) trained on the same data for the same token budget, same seed and settings.

    python experiments/families.py [--steps N] [--data stdlib|synthetic|DIR]
        [--only tiny qwen3-moe-tiny ...]

Each family is one `dropless.train.train` run of its tiny preset (about 1M parameters each),
on real text by default (the Python standard library, byte-level: what `dropless train`
trains on). Reported per family: parameters (total, active), held-out cross-entropy over
training (`--eval-every`) and at the end, and MaxVio (max over experts of load / mean load -
1, averaged over MoE layers) over training. Each family keeps its own routing and balancing
as its preset says (DeepSeek-V3's expert bias; the others' softmax top-k, gpt-oss's with its
router's learnt bias), with the same
`TrainConfig`.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    fit_to_data,
    machine,
    parser,
    print_table,
    smoothed,
    train_config,
    write_results,
)

from dropless.models import get_preset  # noqa: E402
from dropless.models.deepseek_v3 import count_params  # noqa: E402
from dropless.train import train  # noqa: E402

FAMILIES = {
    "tiny": "DeepSeek-V3",
    "qwen3-moe-tiny": "Qwen3-MoE",
    "mixtral-tiny": "Mixtral",
    "olmoe-tiny": "OLMoE",
    "gpt-oss-tiny": "gpt-oss",
}


def main(argv=None) -> list[dict]:
    p = parser("families", __doc__, steps=150)
    p.add_argument("--data", default="stdlib", help="'stdlib' (default), 'synthetic' or a dir")
    p.add_argument("--eval-every", type=int, default=30, help="steps between evaluations")
    p.add_argument("--only", nargs="*", default=None, choices=list(FAMILIES), help="presets")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    rows, curves = [], {}
    for preset, family in FAMILIES.items():
        if args.only and preset not in args.only:
            continue
        tc = train_config(args, eval_every=args.eval_every)
        config = fit_to_data(get_preset(preset), tc)
        res = train(config, tc, backend="jnp", out_dir=str(out / preset))
        rec, evals = res.records, res.eval_records
        counts = count_params(config)
        curves[family] = dict(
            eval_step=[r["step"] for r in evals],
            eval_ce=[r["ce"] for r in evals],
            max_vio=[r["max_vio"] for r in rec],
        )
        tail = rec[-max(1, len(rec) // 10) :]
        rows.append(
            dict(
                family=family,
                preset=preset,
                params=counts.total + counts.mtp,
                active=counts.active + counts.mtp_active,
                tokens=args.steps * args.batch_size * args.seq_len,
                eval_ce=float(res.final_eval["ce"]),
                max_vio_last10pct=float(np.mean([r["max_vio"] for r in tail])),
                step_ms=1e3 * float(np.median([r["step_time"] for r in rec[1:]] or [0.0])),
            )
        )
    meta = dict(machine=machine(), steps=args.steps, data=args.data, seed=args.seed)
    meta.update(batch_size=args.batch_size, seq_len=args.seq_len)
    write_results(out, "families", rows, {**meta, "curves": curves})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    window = max(1, args.steps // 20)
    for family, c in curves.items():
        axes[0].plot(c["eval_step"], c["eval_ce"], marker="o", label=family)
        axes[1].plot(*smoothed(c["max_vio"], window), label=family)
    axes[0].set(xlabel="step", ylabel="held-out cross-entropy (nats)", title="eval loss")
    axes[1].set(xlabel="step", ylabel="MaxVio (mean over MoE layers)", title="imbalance")
    for ax in axes:
        ax.legend()
    tokens = args.steps * args.batch_size * args.seq_len
    fig.suptitle(f"tiny presets on {args.data} data, {tokens:,} tokens each")
    fig.tight_layout()
    fig.savefig(out / "families.png", dpi=80)
    plt.close(fig)
    print_table(rows, f"families ({meta['machine']})")
    return rows


if __name__ == "__main__":
    main()
