"""Balancing ablation: no balancing, the batch / sequence-wise / global-batch aux losses, the
aux-loss-free bias with the sign and the PID rule, and the bias with zero-computation experts,
same model, data, seed and token budget.

    python experiments/balancing.py [--size tiny|small] [--steps N] [--aux C] [--rate R]
        [--micro-batches M] [--zero Z] [--data stdlib|synthetic|DIR] [--only NAME ...]

Every variant is one `dropless.train.train` run on the default corpus (the Python standard
library, byte-level) unless `--data` says otherwise, each step in `--micro-batches` slices (the
per-micro-batch and the global-batch losses then differ). The tiny preset routes without expert
groups here (n_group=1), which zero-computation experts need, so that every variant routes
alike. Reported per variant: held-out cross-entropy at the end; MaxVio (mean over MoE layers,
last 10% of steps); dead experts in training (no token chose them in the last quarter of the
steps, all MoE layers: the records' `dead_experts`) and held out (no held-out token chose them);
router entropy (held-out, mean over layers, nats); computing experts per token. The results
record the whole run's wall time and the load average around it. Plots: curves of train
cross-entropy, MaxVio, router entropy and dead experts, and one layer's expert-pair
co-selection per variant.
"""

import os
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    fit_to_data,
    machine,
    model_config,
    parser,
    print_table,
    smoothed,
    train_config,
    write_results,
)

from dropless import coselection, dead_experts  # noqa: E402
from dropless.train import train  # noqa: E402
from dropless.train.loop import open_data  # noqa: E402
from dropless.train.step import all_moe_stats  # noqa: E402

CURVES = ("ce", "max_vio", "router_entropy", "dead_experts")
OFF = dict(
    balance_loss_coef=0.0,
    seq_balance_loss_coef=0.0,
    global_balance_loss_coef=0.0,
    bias_update_rate=0.0,
)


def variants(aux: float, rate: float, zero: int) -> dict[str, tuple[dict, dict]]:
    """name -> (TrainConfig changes, model config changes)."""
    return {
        "none": (OFF, {}),
        "batch_aux": ({**OFF, "balance_loss_coef": aux}, {}),
        "seq_aux": ({**OFF, "seq_balance_loss_coef": aux}, {}),
        "global_aux": ({**OFF, "global_balance_loss_coef": aux}, {}),
        "bias_sign": ({**OFF, "bias_update_rate": rate}, {}),
        "bias_pid": ({**OFF, "bias_update_rate": rate}, {"bias_update": "pid"}),
        "bias+zero": ({**OFF, "bias_update_rate": rate}, {"n_zero_experts": zero}),
    }


@eqx.filter_jit
def _routing(model, tokens):
    out = model(tokens[:, :-1], return_routing=True)
    return out.moe_stats.expert_ids, all_moe_stats(out)


def held_out_routing(model, data, config) -> dict:
    """Routing diagnostics of `model` on the run's held-out batches (main MoE layers)."""
    loads, entropy, active, cosel = [], [], [], None
    n_experts = model.config.n_routed_experts
    for i in range(config.eval_batches):
        batch = data.eval.batch(
            i, seq_len=config.seq_len, seed=config.seed, batch_size=config.batch_size, split="eval"
        )
        ids, stats = _routing(model, jnp.asarray(batch.tokens))
        loads.append(np.asarray(stats.tokens_per_expert))
        entropy.append(float(stats.router_entropy.mean()))
        active.append(float(stats.active_experts.mean()))
        layer = jnp.where(ids[0] < n_experts, ids[0], n_experts)  # zero experts: no pair
        c = np.asarray(coselection(layer, n_experts + 1))[:n_experts, :n_experts]
        cosel = c if cosel is None else cosel + c
    return dict(
        dead=int(np.asarray(dead_experts(jnp.asarray(np.stack(loads)))).sum()),
        entropy=float(np.mean(entropy)),
        active=float(np.mean(active)),
        coselection=cosel,
    )


def main(argv=None) -> list[dict]:
    began, load_before = time.perf_counter(), os.getloadavg()
    p = parser("balancing", __doc__, steps=100)
    p.add_argument("--aux", type=float, default=1e-2, help="aux loss coefficient")
    p.add_argument("--rate", type=float, default=1e-2, help="expert-bias update rate")
    p.add_argument("--micro-batches", type=int, default=2, help="slices per step")
    p.add_argument("--zero", type=int, default=4, help="zero-computation experts")
    p.add_argument(
        "--data", default="stdlib", help="'stdlib' (default), 'synthetic' or a prepared dir"
    )
    names = list(variants(0, 0, 0))
    p.add_argument("--only", nargs="*", default=None, choices=names, help="run only these")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    # the records' dead experts: none chosen in the last quarter of the run
    run = dict(micro_batches=args.micro_batches, eval_batches=2)
    run["dead_expert_steps"] = max(1, args.steps // 4)
    base_tc = train_config(args, **run)
    base_mc = fit_to_data(model_config(args, n_group=1, topk_group=1), base_tc)
    data = open_data(base_tc, base_mc.vocab_size)
    rows, curves, coselections = [], {}, {}
    for name, (train_changes, model_changes) in variants(args.aux, args.rate, args.zero).items():
        if args.only and name not in args.only:
            continue
        print(f"--- {name}", flush=True)
        tc = train_config(args, **run, **train_changes)
        res = train(base_mc.replace(**model_changes), tc, backend="jnp", out_dir=str(out / name))
        rec = res.records
        tail = rec[-max(1, len(rec) // 10) :]
        held = held_out_routing(res.state.model, data, tc)
        curves[name] = {key: [r[key] for r in rec] for key in CURVES}
        coselections[name] = held.pop("coselection")
        rows.append(
            dict(
                variant=name,
                eval_ce=float(res.final_eval["ce"]),
                max_vio_last10pct=float(np.mean([r["max_vio"] for r in tail])),
                dead_experts_train=int(rec[-1]["dead_experts"]),
                dead_experts_held_out=held["dead"],
                router_entropy=held["entropy"],
                active_experts=held["active"],
                step_ms=1e3 * float(np.median([r["step_time"] for r in rec[1:]] or [0.0])),
            )
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    meta = dict(
        benchmark="experiments/balancing.py",
        machine=machine(),
        command="python " + " ".join(["experiments/balancing.py", *(argv or sys.argv[1:])]),
        commit=commit,
        size=args.size,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        micro_batches=args.micro_batches,
        aux=args.aux,
        rate=args.rate,
        pid_gains=dict(kp=base_mc.bias_pid_kp, ki=base_mc.bias_pid_ki, kd=base_mc.bias_pid_kd),
        dead_expert_steps=run["dead_expert_steps"],
        eval_batches=run["eval_batches"],
        zero=args.zero,
        data=args.data,
        moe_layers=base_mc.n_moe_layers,
        experts=base_mc.n_routed_experts,
    )
    cosel = {name: c.tolist() for name, c in coselections.items()}
    plot(out, curves, coselections, args)
    meta.update(wall_s=round(time.perf_counter() - began, 1), load_average_before=load_before)
    meta["load_average_after"] = os.getloadavg()  # 1, 5, 15 minutes: how idle the box was
    write_results(out, "balancing", rows, {**meta, "curves": curves, "coselection": cosel})
    print(f"wall time {meta['wall_s'] / 60:.1f} min", flush=True)
    print_table(rows, f"balancing ({meta['machine']})")
    return rows


def plot(out: pathlib.Path, curves: dict, coselections: dict, args) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    window = max(1, args.steps // 20)
    for name, c in curves.items():
        for ax, key in zip(axes, CURVES, strict=True):
            if key == "dead_experts":  # a count over a window already: not smoothed
                ax.step(range(1, len(c[key]) + 1), c[key], where="post", label=name)
            else:
                ax.plot(*smoothed(c[key], window), label=name)
    axes[0].set(xlabel="step", ylabel="train cross-entropy (nats)", title="loss")
    axes[1].set(xlabel="step", ylabel="MaxVio (mean over MoE layers)", title="imbalance")
    axes[1].set_yscale("log")
    axes[2].set(xlabel="step", ylabel="router entropy (nats)", title="router entropy")
    quarter = max(1, args.steps // 4)
    axes[3].set(
        xlabel="step",
        ylabel="dead experts (all MoE layers)",
        title=f"no token chose them in the last {quarter} steps",
    )
    axes[3].set_ylim(bottom=0, top=max(1, *(max(c["dead_experts"]) for c in curves.values())))
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{args.size} on {args.data}, {args.steps} steps, smoothed over {window}")
    fig.tight_layout()
    fig.savefig(out / "balancing.png", dpi=80)
    plt.close(fig)
    if not coselections:
        return
    fig, axes = plt.subplots(1, len(coselections), figsize=(2.6 * len(coselections), 2.9))
    for ax, (name, c) in zip(np.atleast_1d(axes), coselections.items(), strict=True):
        c = c.astype(float)
        np.fill_diagonal(c, 0.0)
        ax.imshow(c / max(c.max(), 1.0), cmap="viridis", vmin=0, vmax=1)
        ax.set(title=name, xticks=[], yticks=[])
    fig.suptitle("held-out expert-pair co-selection, first MoE layer (each panel scaled to 1)")
    fig.tight_layout()
    fig.savefig(out / "balancing_coselection.png", dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
