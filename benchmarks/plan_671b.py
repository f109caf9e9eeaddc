"""The tables of docs/plan-671b.md: `dropless plan` for DeepSeek-V3 671B over FSDP x EP meshes.

    python benchmarks/plan_671b.py [--out benchmarks/results]

Every row: 4096-token sequences, bf16 compute and AdamW moments, float32 master weights,
remat "full", cuDNN attention (planned as what it keeps), one optimizer step per batch.
`per GPU` sequences of each micro-batch; `recv` the expert-parallel receive buffer (None: the
worst case, every copy on one device; 2: twice the balanced share, the seed recipe's factor).
"""

import argparse
import dataclasses
import pathlib
import subprocess

from _timing import machine, print_table, write_results

from dropless.models.deepseek_v3 import get_preset
from dropless.train.plan import plan

GB = 1e9
ROWS = [  # (mesh, sequences per GPU, recv factor, device memory GB)
    ("fsdp=16,expert=8", 1, None, 141),
    ("fsdp=16,expert=8", 1, 2.0, 141),
    ("fsdp=16,expert=8", 6, 2.0, 288),
    ("fsdp=8,expert=8", 1, None, 141),
    ("fsdp=32,expert=8", 1, None, 141),
    ("fsdp=64,expert=16", 1, None, 141),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results"
    )
    args = parser.parse_args()
    config = get_preset(
        "deepseek-v3-671b", compute_dtype="bfloat16", remat="full", attention_impl="cudnn"
    )
    rows = []
    for mesh, per_gpu, recv, memory in ROWS:
        p = plan(
            config,
            mesh,
            per_gpu * devices(mesh),
            4096,
            moments_dtype="bfloat16",
            device_memory=memory * GB,
            recv_factor=recv,
        )
        fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
        rows.append(
            {
                "GPUs": p.devices,
                "mesh": mesh,
                "per GPU": per_gpu,
                "recv": "worst" if recv is None else recv,
                "params": sum(fields["params"].values()) / GB,
                "grads": sum(fields["grads"].values()) / GB,
                "moments": sum(fields["moments"].values()) / GB,
                "fsdp gathered": fields["fsdp_gathered"] / GB,
                "activations": fields["activations"] / GB,
                "ep buffers": fields["ep_buffers"] / GB,
                "total GB": p.total / GB,
                "of GB": memory,
                "fits": p.total <= memory * GB,
            }
        )
    print_table(rows, "DeepSeek-V3 671B per GPU (GB = 1e9 bytes)")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    meta = {
        "benchmark": "plan_671b.py (dropless plan for DeepSeek-V3 671B)",
        "machine": machine(),
        "command": "python benchmarks/plan_671b.py",
        "commit": commit,
    }
    write_results(args.out, "plan_671b", rows, meta)


def devices(mesh: str) -> int:
    n = 1
    for part in mesh.split(","):
        n *= int(part.split("=")[1])
    return n


if __name__ == "__main__":
    main()
