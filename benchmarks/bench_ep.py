"""Expert parallelism on emulated CPU devices: step time against one device at equal global work,
and the bytes each device sends against the minimum the routing requires.

    python benchmarks/bench_ep.py [--out results/bench_ep] [--devices 8] [--tokens 4096]

Every configuration trains the same MoE layer (forward + backward of a fixed loss) on the same
global batch. "single" runs it on one device; "ep=N" runs it on all devices, the experts split N
ways (mesh data = devices / N, expert = N), through `dropless.sharding.shard_moe` and the padded
all-to-all of `AllToAllDispatcher` (overflow="drop" where `recv_factor` is set, so undersized
buffers show their drop counts); "dp" runs it data-parallel on all devices with no exchange (every
device all experts). Emulated devices share this machine's cores but run concurrently, so "x one"
mixes that concurrency in; "x dp" has the same concurrency and arithmetic, though the grouped
matmul's loop over local experts differs (all experts per device there, experts / N here).

Bytes: per device and step, the exchange moves rows four times (dispatch and combine forward,
their transposes backward). "sent" counts the off-device rows of the padded buffers as compiled
(every slot travels, full or not); "copies" counts the routed copies that leave their device (what
a ragged exchange sends); "min" counts distinct (token, other device) pairs (what a deduplicating
exchange would send: a token needs to reach a device once, whatever the number of its experts
there). Ratios are taken within the same run. Writes JSON, CSV and a PNG plot under --out.
"""

import argparse
import os
import sys

if "jax" not in sys.modules:  # emulated devices must be asked for before jax starts
    _n = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), None)
    if _n is None and "--devices" in sys.argv:
        _n = sys.argv[sys.argv.index("--devices") + 1]
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={_n or 8}")

import csv  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dropless import (
    MoE,  # noqa: E402
    RoutingSpec,  # noqa: E402
    sharding,  # noqa: E402
)
from dropless.backends import (  # noqa: E402
    AllToAllDispatcher,
    ep_backend,
    with_backend,  # noqa: E402
)

# The receive buffer's per-pair bound is an internal of the private `_ep` module.
from dropless.backends._ep import pair_bound  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="results/bench_ep", help="results folder")
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
    p.add_argument("--tokens", type=int, default=4096, help="global tokens per step")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256, help="expert FFN width")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--ep", default="2,4,8", help="expert-axis sizes to run")
    p.add_argument("--factors", default="none,2.0,1.25", help="recv_factor values ('none' = worst)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per configuration")
    p.add_argument("--skew", type=float, default=1.0, help="bias of the favoured experts x E")
    return p.parse_args()


def make_moe(args, routing: str) -> MoE:
    spec = RoutingSpec(args.experts, args.k, use_expert_bias=True)
    moe = MoE(args.dim, args.hidden, spec, key=jax.random.key(0))
    bias = np.zeros(args.experts, np.float32)
    if routing == "skewed":  # the first quarter of the experts gets about twice its share
        bias[: args.experts // 4] = args.skew / args.experts
    return eqx.tree_at(lambda m: m.router.expert_bias, moe, jnp.asarray(bias))


def step_fn(layer, x, probe):
    def loss(args):
        layer, x = args
        y, stats = layer(x)
        return jnp.sum(y * probe), stats.dropped

    (_, dropped), grads = eqx.filter_value_and_grad(loss, has_aux=True)((layer, x))
    return grads, dropped


def time_step(layer, x, probe, repeats: int) -> tuple[float, float, float]:
    """(median seconds per step, compile seconds, copies dropped)."""
    step = eqx.filter_jit(step_fn)
    t0 = time.perf_counter()
    _, dropped = jax.block_until_ready(step(layer, x, probe))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(layer, x, probe))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), compile_s, float(dropped)


def traffic(expert_ids: np.ndarray, args, ep: int, factor) -> dict:
    """Rows each device sends per step (max over devices), by the three measures above."""
    n_dev = args.devices
    local_tokens = args.tokens // n_dev
    copies = local_tokens * args.k
    per_expert_dev = args.experts // ep
    bound = pair_bound(copies, ep, factor)
    remote_copies, remote_pairs = [], []
    for s in range(n_dev):
        me = s % ep
        ids = expert_ids[s * local_tokens : (s + 1) * local_tokens]
        dest = ids // per_expert_dev
        remote_copies.append(int((dest != me).sum()))
        pairs = {(t, d) for t, row in enumerate(dest) for d in row if d != me}
        remote_pairs.append(len(pairs))
    row_bytes = args.dim * 4  # float32 rows
    exchanges = 4  # dispatch, combine, and both transposes
    return {
        "sent_bytes": exchanges * (ep - 1) * bound * row_bytes,
        "copies_bytes": exchanges * max(remote_copies) * row_bytes,
        "min_bytes": exchanges * max(remote_pairs) * row_bytes,
    }


def main():
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    devices = jax.devices()[: args.devices]
    if len(devices) < args.devices:
        sys.exit(f"needs {args.devices} devices, has {len(devices)} (XLA_FLAGS set elsewhere?)")
    key_x, key_p = jax.random.split(jax.random.key(1))
    x = jax.random.normal(key_x, (args.tokens, args.dim))
    probe = jax.random.normal(key_p, (args.tokens, args.dim))
    eps = [int(e) for e in args.ep.split(",")]
    factors = [None if f == "none" else float(f) for f in args.factors.split(",")]

    rows = []
    for routing in ("random", "skewed"):
        moe = make_moe(args, routing)
        ids = np.asarray(moe.router(x).expert_ids)
        common = dict(routing=routing, max_vio=_vio(np.bincount(ids.reshape(-1))))
        on_one = [jax.device_put(a, devices[0]) for a in (moe, x, probe)]
        base, compile_s, _ = time_step(*on_one, args.repeats)
        rows.append(
            dict(
                common,
                config="single",
                recv_factor="-",
                step_ms=1e3 * base,
                x_single=1.0,
                compile_s=compile_s,
                dropped=0.0,
            )
        )
        # Data parallel on every device, no exchange: the same concurrency as EP, so EP / DP is
        # the cost of expert parallelism itself.
        dp_mesh = sharding.make_mesh(data=args.devices, devices=devices)
        dp, compile_s, _ = time_step(sharding.shard_moe(moe, dp_mesh), x, probe, args.repeats)
        rows.append(
            dict(
                common,
                config="dp",
                recv_factor="-",
                step_ms=1e3 * dp,
                x_single=dp / base,
                x_dp=1.0,
                compile_s=compile_s,
                dropped=0.0,
            )
        )
        print(
            f"[{routing}] MaxVio {common['max_vio']:.2f}: one device {1e3 * base:.1f} ms, "
            f"data parallel x{args.devices} {1e3 * dp:.1f} ms",
            flush=True,
        )
        for ep in eps:
            mesh = sharding.make_mesh(data=args.devices // ep, expert=ep, devices=devices)
            for factor in factors:
                dispatcher = AllToAllDispatcher(recv_factor=factor, overflow="drop")
                layer = eqx.tree_at(
                    lambda m: m.dispatcher, with_backend(moe, ep_backend()), dispatcher
                )
                t, compile_s, dropped = time_step(
                    sharding.shard_moe(layer, mesh), x, probe, args.repeats
                )
                row = dict(
                    common,
                    config=f"ep={ep}",
                    recv_factor="none" if factor is None else factor,
                    step_ms=1e3 * t,
                    x_single=t / base,
                    x_dp=t / dp,
                    compile_s=compile_s,
                    dropped=dropped,
                )
                row.update(traffic(ids, args, ep, factor))
                row["sent_over_min"] = row["sent_bytes"] / max(row["min_bytes"], 1)
                row["copies_over_min"] = row["copies_bytes"] / max(row["min_bytes"], 1)
                rows.append(row)
                print(
                    f"[{routing}] ep={ep} recv_factor={row['recv_factor']}: "
                    f"{row['step_ms']:.1f} ms ({row['x_single']:.2f}x one device, "
                    f"{row['x_dp']:.2f}x dp), sent {row['sent_over_min']:.1f}x min, "
                    f"dropped {dropped:.0f}",
                    flush=True,
                )

    meta = dict(
        machine=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        jax=jax.__version__,
        backend=jax.default_backend(),
        **{k: v for k, v in vars(args).items() if k != "out"},
    )
    (out / "bench_ep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    fields = list(dict.fromkeys(k for r in rows[::-1] for k in r))
    with open(out / "bench_ep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print_table(rows, meta)
    plot(rows, out / "bench_ep.png", meta)
    print(f"wrote {out}/bench_ep.json, bench_ep.csv, bench_ep.png")


def _vio(load: np.ndarray) -> float:
    return float(load.max() / load.mean() - 1)


def print_table(rows, meta):
    print(
        f"\n{meta['devices']} emulated devices on {meta['cpu_count']} cores, jax {meta['jax']}; "
        f"{meta['tokens']} tokens, dim {meta['dim']}, hidden {meta['hidden']}, "
        f"{meta['experts']} experts, top-{meta['k']}; float32; fwd+bwd step, median of "
        f"{meta['repeats']}"
    )
    head = (
        f"{'routing':8} {'config':7} {'recv':>5} {'ms/step':>8} {'x one':>6} {'x dp':>6} "
        f"{'sent MiB':>9} {'copies MiB':>10} {'min MiB':>8} {'sent/min':>8} {'dropped':>7}"
    )
    print(head)
    print("-" * len(head))
    mib = 2**20
    for r in rows:
        cells = [
            f"{r['routing']:8}",
            f"{r['config']:7}",
            f"{str(r['recv_factor']):>5}",
            f"{r['step_ms']:8.1f}",
            f"{r['x_single']:6.2f}",
            f"{r['x_dp']:6.2f}" if "x_dp" in r else f"{'':6}",
        ]
        if "sent_bytes" in r:
            cells += [
                f"{r['sent_bytes'] / mib:9.2f}",
                f"{r['copies_bytes'] / mib:10.2f}",
                f"{r['min_bytes'] / mib:8.2f}",
                f"{r['sent_over_min']:8.1f}",
            ]
        else:
            cells += [f"{'':9}", f"{'':10}", f"{'':8}", f"{'':8}"]
        print(" ".join([*cells, f"{r['dropped']:7.0f}"]))


def plot(rows, path: Path, meta: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep_rows = [r for r in rows if r["config"].startswith("ep")]
    labels = [f"{r['routing'][:4]} {r['config']} rf={r['recv_factor']}" for r in ep_rows]
    pos = np.arange(len(ep_rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.35 * len(ep_rows) + 2))
    axes[0].barh(pos - 0.2, [r["x_single"] for r in ep_rows], 0.4, label="/ one device")
    axes[0].barh(pos + 0.2, [r["x_dp"] for r in ep_rows], 0.4, label="/ data parallel")
    axes[0].set_xlabel("EP step time over the baselines (same global work)")
    axes[1].barh(pos - 0.2, [r["sent_over_min"] for r in ep_rows], 0.4, label="padded (sent)")
    axes[1].barh(pos + 0.2, [r["copies_over_min"] for r in ep_rows], 0.4, label="ragged (copies)")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("bytes sent per device / minimum (distinct token-device pairs)")
    for ax in axes:
        ax.set_yticks(pos, labels)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
        ax.legend()
    fig.suptitle(
        f"AllToAllDispatcher on {meta['devices']} emulated CPU devices "
        f"({meta['cpu_count']} cores), {meta['tokens']} tokens, {meta['experts']} experts, "
        f"top-{meta['k']}, dim {meta['dim']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
