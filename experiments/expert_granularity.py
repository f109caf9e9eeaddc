"""Expert granularity at fixed active (and total) parameters: sweep (experts, top-k) with
`moe_intermediate_size` scaled so that top-k * size (active expert FLOPs) and experts * size
(routed parameters) stay equal; report loss at a fixed number of tokens and the step time.

    python experiments/expert_granularity.py [--size tiny|small] [--steps N] [--sweep 8/2 16/4]
        [--data synthetic|stdlib|DIR]

Routing is ungrouped (n_group=1) so that every setting chooses top-k among all its experts.
Trains on the built-in synthetic corpus, or with `--data` on real text (the model's vocabulary
then the tokenizer's).
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

from dropless.models.deepseek_v3 import count_params  # noqa: E402
from dropless.train import train  # noqa: E402


def main(argv=None) -> list[dict]:
    p = parser("expert_granularity", __doc__, steps=150)
    p.add_argument("--sweep", nargs="+", default=["8/2", "16/4", "32/8"], help="experts/top-k")
    add_data_option(p)
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    base = fit_to_data(model_config(args), train_config(args))
    sweep = [(setting, tuple(int(v) for v in setting.split("/"))) for setting in args.sweep]
    # active expert width of the first setting, kept for all of them
    e0, k0 = sweep[0][1]
    width = base.moe_intermediate_size * k0
    for setting, (experts, k) in sweep:  # all checked before anything trains
        if experts * k0 != e0 * k:
            raise ValueError(
                f"{setting}: experts / top-k must be the first setting's {e0}/{k0}, so that "
                "the routed parameters stay equal"
            )
        if width % k or (base.n_shared_experts * k) % k0:
            raise ValueError(
                f"{setting}: the active width {width} and the shared width must divide evenly "
                f"(top-k {k} against the first setting's {k0})"
            )
    rows, curves = [], {}
    for setting, (experts, k) in sweep:
        # The shared experts' width is n_shared_experts * moe_intermediate_size: scale their
        # count so that it, too, stays fixed while the routed experts get finer.
        mc = base.replace(
            n_routed_experts=experts,
            num_experts_per_tok=k,
            moe_intermediate_size=width // k,
            n_shared_experts=base.n_shared_experts * k // k0,
            n_group=1,
            topk_group=1,
        )
        res = train(mc, train_config(args), backend="jnp", out_dir=str(out / f"e{experts}k{k}"))
        rec = res.records
        tail = rec[-max(1, len(rec) // 10) :]
        counts = count_params(mc)
        curves[setting] = [r["ce"] for r in rec]
        rows.append(
            dict(
                experts=experts,
                top_k=k,
                expert_size=width // k,
                total_params=counts.total,
                active_params=counts.active,
                tokens=args.steps * args.batch_size * args.seq_len,
                ce_last10pct=float(np.mean([r["ce"] for r in tail])),
                eval_ce=float(res.final_eval["ce"]),
                max_vio_last10pct=float(np.mean([r["max_vio"] for r in tail])),
                step_ms=1e3 * float(np.median([r["step_time"] for r in rec[1:]] or [0.0])),
            )
        )
    meta = dict(machine=machine(), size=args.size, steps=args.steps, active_width=width)
    meta["data"] = args.data
    write_results(out, "expert_granularity", rows, {**meta, "curves": curves})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    n = max(1, args.steps // 20)
    for setting, ce in curves.items():
        axes[0].plot(*smoothed(ce, n), label=setting)
    title = f"loss (experts/top-k), {args.data} data"
    axes[0].set(xlabel="step", ylabel="train cross-entropy (nats)", title=title)
    axes[0].legend()
    labels = [f"{r['experts']}/{r['top_k']}" for r in rows]
    axes[1].bar(labels, [r["step_ms"] for r in rows])
    axes[1].set(xlabel="experts/top-k", ylabel="median step time (ms)", title="speed")
    fig.tight_layout()
    fig.savefig(out / "expert_granularity.png", dpi=80)
    plt.close(fig)
    print_table(rows, f"expert granularity ({meta['machine']})")
    return rows


if __name__ == "__main__":
    main()
