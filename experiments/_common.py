"""Shared helpers for the scripted experiments: arguments, configs, a layer-by-layer forward,
and the timer, tables and result files (JSON + CSV) that the benchmarks use too."""

import argparse
import csv
import json
import pathlib
import statistics
import sys
import time

import matplotlib

matplotlib.use("Agg")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset, scan_blocks, unstack  # noqa: E402
from dropless.train import TrainConfig  # noqa: E402
from dropless.train.loop import fit_vocab, open_data  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def parser(name: str, doc: str, *, steps: int | None) -> argparse.ArgumentParser:
    """The arguments every experiment takes: --size, --out (and batch/seq/seed), and --steps
    for those that train (`steps` its default; None: the experiment does not train)."""
    p = argparse.ArgumentParser(prog=f"experiments/{name}.py", description=doc)
    p.add_argument("--size", default="tiny", choices=["tiny", "small"], help="model preset")
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps, help="training steps per run")
    p.add_argument("--out", default=f"results/{name}", help="results folder")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p


def add_data_option(p: argparse.ArgumentParser) -> None:
    """--data: 'synthetic' (the default: the built-in Markov corpus), 'stdlib' (real text, the
    Python standard library byte-level) or a directory made by `dropless prepare`."""
    p.add_argument(
        "--data",
        default="synthetic",
        help="'synthetic' (default), 'stdlib' (real text) or a prepared data directory",
    )


def fit_to_data(config, train: TrainConfig):
    """`config` with the vocabulary of the data's tokenizer (as `dropless train` sets it)."""
    return fit_vocab(config, open_data(train, config.vocab_size), given=False)


def train_config(args, **changes) -> TrainConfig:
    """A short run: no periodic eval/checkpoints/plots (train() still evaluates and saves once),
    on `args.data` where the experiment takes --data, else on the synthetic corpus."""
    base = dict(
        data=getattr(args, "data", "synthetic"),
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        warmup_steps=min(20, max(args.steps // 10, 1)),
        eval_every=0,
        checkpoint_every=0,
        eval_batches=2,
        plots=False,
    )
    return TrainConfig(**{**base, **changes})


def model_config(args, **overrides):
    return get_preset(args.size, **overrides)


def moe_forward(model: DeepSeekV3, tokens, moe_fn=None):
    """The main model's logits, computed layer by layer so each MoE layer can be observed or
    replaced: `moe_fn(moe, h_flat, seq_len) -> y_flat` (default: the layer itself).

    Returns (logits [batch seq vocab], MoE inputs: one [tokens dim] array per MoE layer).
    MTP modules are left out (they do not change the main logits).
    """
    c = model.config
    x = jnp.take(model.embed_tokens, tokens, axis=0).astype(c.compute_jnp_dtype)
    x, _ = scan_blocks(model.dense_layers, x)
    inputs = []
    for i in range(c.n_moe_layers):
        block = unstack(model.moe_layers, i)
        x = x + block.self_attn(block.input_layernorm(x))
        h = block.post_attention_layernorm(x)
        b, s, d = h.shape
        flat = h.reshape(b * s, d)
        inputs.append(flat)
        y = block.mlp(flat, seq_len=s)[0] if moe_fn is None else moe_fn(block.mlp, flat, s)
        x = x + y.reshape(b, s, d).astype(x.dtype)
    return model.head(model.norm(x)), inputs


def cross_entropy(logits, window) -> jax.Array:
    """Mean next-token cross-entropy of logits of window[:, :-1] against window[:, 1:]."""
    labels = window[:, 1:]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return ce.mean()


def moe_layers(model: DeepSeekV3) -> list[eqx.Module]:
    """The MoE modules of the main stack, one per layer (unstacked)."""
    return [unstack(model.moe_layers, i).mlp for i in range(model.config.n_moe_layers)]


def smoothed(values, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values): the moving average over `window` steps of a per-step series (steps 1,
    2, ...), each average placed at the last step it covers."""
    values = np.asarray(values, float)
    window = max(1, min(window, len(values)))
    return np.arange(window, len(values) + 1), np.convolve(
        values, np.ones(window) / window, mode="valid"
    )


def median_time(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time of fn(*args) in seconds, after warm-up (compilation excluded)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_table(rows: list[dict], title: str = "") -> None:
    if title:
        print(f"\n{title}")
    if not rows:
        return
    keys = list(rows[0])
    cells = [[_fmt(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths, strict=True)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def write_results(out: pathlib.Path, name: str, rows: list[dict], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if rows:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(out / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)


def machine() -> str:
    d = jax.devices()[0]
    return (
        f"{d.platform}:{getattr(d, 'device_kind', '')} x{jax.device_count()}, jax {jax.__version__}"
    )
