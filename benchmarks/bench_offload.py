"""Optimizer-state host offload on a GPU: device memory of the train state and step time, with
the Adam moments on the device and in pinned host memory (`TrainConfig.offload_optimizer`).

    python benchmarks/bench_offload.py [--preset small] [--steps 10] [--batch-size 8]
        [--seq-len 512] [--out results/bench_offload.json]

For each mode it trains `--steps` steps (the first compiles and is left out of the time) and
reports the state's bytes on the device and on the host (`offload.state_bytes`), the device's
peak bytes in use (`memory_stats`, where the backend reports it) and the median step time.
The line to quote: "moments offloaded: X GiB less device memory at rest, peak A -> B GiB, step
time C -> D ms".
"""

import argparse
import dataclasses
import json
import os
import statistics
import tempfile

import jax

from dropless.models.deepseek_v3 import get_preset
from dropless.train import TrainConfig, train

# The state's bytes per memory kind are an internal of the private `_offload` module.
from dropless.train.loop import _offload as offload

GIB = 2**30


def measure(preset: str, config: TrainConfig) -> dict:
    with tempfile.TemporaryDirectory() as out:
        results = train(get_preset(preset), config, out_dir=out)
    state = results.state
    stats = jax.devices()[0].memory_stats() or {}
    times = [r["step_time"] for r in results.records[1:]] or [results.records[0]["step_time"]]
    return {
        "offload_optimizer": config.offload_optimizer,
        "state_device_gib": offload.state_bytes(state, "device") / GIB,
        "state_host_gib": offload.state_bytes(state, offload.HOST) / GIB,
        "peak_device_gib": stats.get("peak_bytes_in_use", 0) / GIB,
        "step_ms": 1e3 * statistics.median(times),
        "final_loss": results.losses[-1],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    base = TrainConfig(
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        warmup_steps=1,
        eval_every=0,
        eval_batches=1,
        checkpoint_every=0,
        plots=False,
    )
    # offloaded first: the device's peak counter only grows, so the smaller peak is read first
    rows = [measure(a.preset, dataclasses.replace(base, offload_optimizer=True))]
    rows.append(measure(a.preset, base))
    host, device = rows
    print(json.dumps(rows, indent=1))
    print(
        f"{a.preset} on {jax.devices()[0].device_kind}: moments offloaded: "
        f"{device['state_device_gib'] - host['state_device_gib']:.3f} GiB less device memory at "
        f"rest, peak {device['peak_device_gib']:.2f} -> {host['peak_device_gib']:.2f} GiB, step "
        f"time {device['step_ms']:.1f} -> {host['step_ms']:.1f} ms"
    )
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"preset": a.preset, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
