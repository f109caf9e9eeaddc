"""Every available backend on the same MoE layer and the same tiny model: agreement with the
dense one-hot oracle (forward and gradient) and time.

    python experiments/compare_backends.py [--size tiny|small] [--tokens N] [--out DIR]

Backends are `dropless.train.available_backends()` minus the multi-device ones ("ep", "nccl_ep").
Layer: `oracle_moe` is the reference. Model: the reference is the same model with the oracle
grouped matmul (`OneHotGroupedMatmul`) in every MoE layer.
"""

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
    parser,
    print_table,
    write_results,
)

import dropless  # noqa: E402
from dropless.backends import (  # noqa: E402
    OneHotGroupedMatmul,
    SortDispatcher,  # noqa: E402
    oracle_moe,
)
from dropless.models.deepseek_v3 import DeepSeekV3, get_preset  # noqa: E402
from dropless.train import SyntheticCorpus, available_backends, get_backend  # noqa: E402

MULTI_DEVICE = ("ep", "nccl_ep")


def errors(got, ref) -> tuple[float, float]:
    """(max abs error, max abs error / max |ref|) over every leaf."""
    got, ref = jax.tree.leaves(got), jax.tree.leaves(ref)
    abs_err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, ref, strict=True))
    scale = max(float(jnp.max(jnp.abs(b))) for b in ref)
    return abs_err, abs_err / max(scale, 1e-30)


def layer_rows(config, names: list[str], tokens: int, repeats: int, seed: int) -> list[dict]:
    k_model, k_x, k_cot = jax.random.split(jax.random.key(seed), 3)
    moe = dropless.MoE(
        config.hidden_size,
        config.moe_intermediate_size,
        config.routing_spec(),
        n_shared_experts=config.n_shared_experts,
        key=k_model,
    )
    x = jax.random.normal(k_x, (tokens, config.hidden_size))
    cot = jax.random.normal(k_cot, (tokens, config.hidden_size))

    def loss(m, x, fn):
        return jnp.sum(fn(m, x) * cot)

    def run(m, x):
        return m(x)[0]

    ref_y = jax.jit(oracle_moe)(moe, x)
    ref_g = eqx.filter_jit(eqx.filter_grad(loss))(moe, x, oracle_moe)
    fwd = eqx.filter_jit(run)
    grad = eqx.filter_jit(eqx.filter_grad(lambda m, x: loss(m, x, run)))
    return [
        agreement_row(
            "layer",
            name,
            dropless.with_backend(moe, get_backend(name)),
            x,
            fwd,
            grad,
            ref_y,
            ref_g,
            repeats,
        )
        for name in names
    ]


def agreement_row(what, name, m, inputs, fwd, grad, ref_y, ref_g, repeats) -> dict:
    """Errors of backend `name` against the oracle's output and gradient, and its times."""
    fa, fr = errors(fwd(m, inputs), ref_y)
    ga, gr = errors(grad(m, inputs), ref_g)
    return dict(
        what=what,
        backend=name,
        fwd_abs=fa,
        fwd_rel=fr,
        grad_abs=ga,
        grad_rel=gr,
        fwd_ms=1e3 * median_time(fwd, m, inputs, repeats=repeats),
        fwd_bwd_ms=1e3 * median_time(grad, m, inputs, repeats=repeats),
    )


def model_rows(
    config, names: list[str], batch: int, seq: int, repeats: int, seed: int
) -> list[dict]:
    model = DeepSeekV3(config, key=jax.random.key(seed))
    window = jnp.asarray(
        SyntheticCorpus(config.vocab_size).batch(0, seed=seed, batch_size=batch, seq_len=seq).tokens
    )

    def logits(m, w):
        return m(w[:, :-1]).logits

    def loss(m, w):
        return cross_entropy(m(w[:, :-1]).logits, w)

    fwd = eqx.filter_jit(logits)
    grad = eqx.filter_jit(eqx.filter_grad(loss))
    oracle = dropless.with_backend(
        model, dropless.Backend(dispatcher=SortDispatcher(), gmm=OneHotGroupedMatmul())
    )
    ref_y, ref_g = fwd(oracle, window), grad(oracle, window)
    return [
        agreement_row(
            "model",
            name,
            dropless.with_backend(model, get_backend(name)),
            window,
            fwd,
            grad,
            ref_y,
            ref_g,
            repeats,
        )
        for name in names
    ]


def plot(rows: list[dict], path: pathlib.Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, what in zip(axes, ("layer", "model"), strict=True):
        sel = [r for r in rows if r["what"] == what]
        pos = np.arange(len(sel))
        ax.bar(pos - 0.2, [r["fwd_ms"] for r in sel], 0.4, label="forward")
        ax.bar(pos + 0.2, [r["fwd_bwd_ms"] for r in sel], 0.4, label="gradient")
        ax.set_xticks(pos, [r["backend"] for r in sel])
        ax.set_ylabel("ms (median)")
        ax.set_title(f"MoE {what}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    p = parser("compare_backends", __doc__, steps=None)
    p.add_argument("--tokens", type=int, default=1024, help="tokens through the MoE layer")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--backends", nargs="+", default=None, help="default: all available")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    config = get_preset(args.size)
    names = args.backends or [b for b in available_backends() if b not in MULTI_DEVICE]
    rows = layer_rows(config, names, args.tokens, args.repeats, args.seed)
    rows += model_rows(config, names, args.batch_size, args.seq_len, args.repeats, args.seed)
    meta = dict(
        machine=machine(),
        size=args.size,
        tokens=args.tokens,
        batch=args.batch_size,
        seq=args.seq_len,
        reference_layer="oracle_moe",
        reference_model="OneHotGroupedMatmul in every MoE layer",
    )
    write_results(out, "compare_backends", rows, meta)
    plot(rows, out / "compare_backends.png")
    print_table(rows, f"backends vs the oracle ({meta['machine']})")
    return rows


if __name__ == "__main__":
    main()
