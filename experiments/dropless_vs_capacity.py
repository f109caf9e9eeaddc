"""The dropless MoE vs a capacity-factor MoE built from the same weights.

    python experiments/dropless_vs_capacity.py [--size tiny|small] [--steps N] [--factors 1 2]

The capacity layer (GShard-style, written below in ~30 lines) gives each expert
C = ceil(factor * tokens * k / experts) slots, fills them with one-hot dispatch masks in priority
order (every token's first choice, then every token's second, ...; earlier tokens first) and
drops the copies that overflow: a dropped copy contributes nothing (the shared expert and the
residual still do). Measured at initialisation and after training a model briefly: dropped
copies and tokens (all k copies dropped), relative output error vs the dropless layer on the
same inputs, held-out cross-entropy with every MoE layer replaced, and layer time.
"""

import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    cross_entropy,
    machine,
    median_time,
    model_config,
    moe_forward,
    moe_layers,
    parser,
    print_table,
    train_config,
    write_results,
)

from dropless import MoE  # noqa: E402
from dropless.models.deepseek_v3 import DeepSeekV3  # noqa: E402
from dropless.train import SyntheticCorpus, train  # noqa: E402


def capacity_moe(moe: MoE, x, capacity: int):
    """The MoE layer with at most `capacity` copies per expert. Returns (y, dropped copies,
    dropped tokens): counts, not fractions."""
    routing = moe.router(x)
    tokens, k = routing.expert_ids.shape
    n_exp = routing.scores.shape[-1]
    mask = jax.nn.one_hot(routing.expert_ids, n_exp, dtype=x.dtype)  # [t k e]
    # slot of each copy in its expert's buffer, in priority order (choice rank, then token)
    by_rank = mask.transpose(1, 0, 2).reshape(k * tokens, n_exp)
    slot = (jnp.cumsum(by_rank, axis=0) - 1).reshape(k, tokens, n_exp).transpose(1, 0, 2)
    keep = mask * (slot < capacity)  # [t k e]
    slot_1h = jax.nn.one_hot(jnp.where(keep > 0, slot, capacity), capacity, dtype=x.dtype)
    dispatch = jnp.einsum("tke,tkec->tec", keep, slot_1h)
    combine = jnp.einsum("tke,tk,tkec->tec", keep, routing.weights.astype(x.dtype), slot_1h)
    ex = moe.experts
    xin = jnp.einsum("tec,td->ecd", dispatch, x)
    h = jax.nn.silu(jnp.einsum("ecd,edh->ech", xin, ex.w_gate)) * jnp.einsum(
        "ecd,edh->ech", xin, ex.w_up
    )
    y = jnp.einsum("tec,ech,ehd->td", combine, h, ex.w_down)
    if moe.shared is not None:
        y = y + moe.shared(x)
    kept = keep.sum(-1)  # [t k]
    return y, tokens * k - kept.sum(), jnp.sum(kept.sum(-1) == 0)


def capacity_of(factor: float, tokens: int, k: int, experts: int) -> int:
    return min(tokens, math.ceil(factor * tokens * k / experts))


@eqx.filter_jit
def dropless_eval(model, window):
    logits, inputs = moe_forward(model, window[:, :-1])
    return cross_entropy(logits, window), inputs


@eqx.filter_jit
def capacity_eval(model, window, capacity: int):
    counts = []

    def fn(moe, h, seq):
        y, copies, toks = capacity_moe(moe, h, capacity)
        counts.append(jnp.stack([copies, toks]))
        return y

    logits, _ = moe_forward(model, window[:, :-1], fn)
    return cross_entropy(logits, window), jnp.stack(counts)  # [layers 2]


def measure(model: DeepSeekV3, window, factors, repeats: int, label: str) -> list[dict]:
    c = model.config
    b, s = window.shape[0], window.shape[1] - 1
    tokens, k, n_exp = b * s, c.num_experts_per_tok, c.n_routed_experts
    ce_dropless, inputs = dropless_eval(model, window)
    moes = moe_layers(model)
    layer_fn = eqx.filter_jit(lambda m, x: m(x)[0])
    y_ref = [layer_fn(m, x) for m, x in zip(moes, inputs, strict=True)]
    t_ref = median_time(layer_fn, moes[0], inputs[0], repeats=repeats)
    rows = [
        dict(
            model=label,
            layer="dropless",
            capacity=None,
            dropped_copies=0.0,
            dropped_tokens=0.0,
            rel_err=0.0,
            eval_ce=float(ce_dropless),
            layer_ms=1e3 * t_ref,
        )
    ]
    cap_fn = eqx.filter_jit(lambda m, x, cap: capacity_moe(m, x, cap)[0])
    for factor in [*factors, None]:
        cap = tokens if factor is None else capacity_of(factor, tokens, k, n_exp)
        ce, counts = capacity_eval(model, window, cap)
        counts = np.asarray(counts)
        errs = []
        for m, x, y in zip(moes, inputs, y_ref, strict=True):
            diff = cap_fn(m, x, cap) - y
            errs.append(float(jnp.linalg.norm(diff) / jnp.linalg.norm(y)))
        rows.append(
            dict(
                model=label,
                layer="no-drop check" if factor is None else f"capacity {factor:g}",
                capacity=cap,
                dropped_copies=float(counts[:, 0].sum() / (tokens * k * len(moes))),
                dropped_tokens=float(counts[:, 1].sum() / (tokens * len(moes))),
                rel_err=float(np.mean(errs)),
                eval_ce=float(ce),
                layer_ms=1e3 * median_time(cap_fn, moes[0], inputs[0], cap, repeats=repeats),
            )
        )
    return rows


def main(argv=None) -> list[dict]:
    p = parser("dropless_vs_capacity", __doc__, steps=150)
    p.add_argument("--factors", nargs="+", type=float, default=[1.0, 1.25, 2.0])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    mc = model_config(args)
    window = jnp.asarray(
        SyntheticCorpus(mc.vocab_size)
        .batch(0, seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len, split="eval")
        .tokens
    )
    init = DeepSeekV3(mc, key=jax.random.key(args.seed))
    # The layer-by-layer forward must agree with the model's own. Both compiled: run eagerly,
    # rounding differs by ~1e-6, enough to flip a near-tie in some token's top-k.
    ref = eqx.filter_jit(lambda m, x: m(x).logits)(init, window[:, :-1])
    logits = eqx.filter_jit(moe_forward)(init, window[:, :-1])[0]
    assert np.allclose(logits, ref, atol=1e-4), "forward mismatch"
    rows = measure(init, window, args.factors, args.repeats, "init")
    trained = train(mc, train_config(args), backend="jnp", out_dir=str(out / "run")).model
    rows += measure(trained, window, args.factors, args.repeats, f"trained {args.steps} steps")
    meta = dict(
        machine=machine(),
        size=args.size,
        steps=args.steps,
        tokens_per_layer_call=args.batch_size * args.seq_len,
    )
    write_results(out, "dropless_vs_capacity", rows, meta)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for label in dict.fromkeys(r["model"] for r in rows):
        sel = [r for r in rows if r["model"] == label and r["layer"].startswith("capacity")]
        f = [float(r["layer"].split()[1]) for r in sel]
        axes[0].plot(f, [r["dropped_copies"] for r in sel], "o-", label=label)
        axes[1].plot(f, [r["rel_err"] for r in sel], "o-", label=label)
        base = next(r for r in rows if r["model"] == label and r["layer"] == "dropless")
        axes[2].plot(f, [r["eval_ce"] for r in sel], "o-", label=f"{label} (capacity)")
        axes[2].axhline(
            base["eval_ce"],
            ls="--",
            color=axes[2].lines[-1].get_color(),
            label=f"{label} (dropless)",
        )
    axes[0].set(xlabel="capacity factor", ylabel="fraction of copies dropped")
    axes[1].set(xlabel="capacity factor", ylabel="relative output error vs dropless")
    axes[2].set(xlabel="capacity factor", ylabel="held-out cross-entropy")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "dropless_vs_capacity.png", dpi=80)
    plt.close(fig)
    print_table(rows, f"dropless vs capacity ({meta['machine']})")
    return rows


if __name__ == "__main__":
    main()
