"""Per-device memory of the sharded train step against depth, from XLA's compiled memory
analysis, and where its FSDP all-gathers sit (inside the layer loop or at the top level).

    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 \
        --xla_cpu_use_fusion_emitters=false" JAX_PLATFORMS=cpu \
        python benchmarks/bench_fsdp_memory.py --layers 2,4,8,16 --meshes fsdp=8 "fsdp=4,expert=2"

Nothing runs: each step is only compiled, on 8 emulated CPU devices. The model (`--model`) is
the tiny preset at width 512 with 8 experts ("tiny512", issue 52's setting), or also with wider
FFNs and latents ("wide": experts 256, dense FFN 1536, ranks 128); remat "full", float32, a
batch of 8 sequences of 32 tokens. With one layer's weights gathered at a time, temp memory
grows with depth by the saved activations and the (sharded) gradients; with the whole model
gathered before the scan, by about two whole layers of weights per layer.
"""

import argparse
import os
import pathlib
import re
import subprocess
import time

import equinox as eqx
import jax
from _timing import machine, print_table, write_results

from dropless import sharding
from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import TrainConfig
from dropless.train.step import init_state, prepare_model, shard_state, sharded_train_step

MB = 1e6


MODELS = {
    "tiny512": {},
    "wide": {
        "intermediate_size": 1536,
        "moe_intermediate_size": 256,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
    },
}


def config(model: str, layers: int):
    return get_preset(
        "tiny",
        hidden_size=512,
        n_routed_experts=8,
        num_hidden_layers=layers,
        remat="full",
        **MODELS[model],
    )


def _computations(hlo: str) -> dict[str, str]:
    """name -> body text of every computation of an HLO module's text."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name, lines = head.group(1), []
        elif line.startswith("}") and name is not None:
            out[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return out


def all_gathers(hlo: str) -> tuple[int, int]:
    """(all-gathers reachable from a while loop's body, all-gathers elsewhere) in `hlo`."""
    comps = _computations(hlo)
    called = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=\{?%?([\w.\-,% ]+)")

    def reachable(roots):
        seen, todo = set(), list(roots)
        while todo:
            c = todo.pop()
            if c in seen or c not in comps:
                continue
            seen.add(c)
            for match in called.finditer(comps[c]):
                todo += [n.strip(" %") for n in match.group(1).split(",")]
        return seen

    body = re.compile(r"body=%?([\w.\-]+)")
    bodies = [m.group(1) for text in comps.values() for m in body.finditer(text)]
    inside = reachable(bodies)

    def count(names):
        return sum(len(re.findall(r"= \S+ all-gather(?:-start)?\(", comps[n])) for n in names)

    return count(inside), count(set(comps) - inside)


def measure(model: str, mesh_spec: str, layers: int) -> dict:
    mesh = sharding.mesh_from_spec(mesh_spec)
    c = config(model, layers)
    train_config = TrainConfig(batch_size=8, seq_len=32)
    model = prepare_model(DeepSeekV3(c, key=jax.random.key(0)), mesh)
    state = shard_state(init_state(model, train_config), mesh)
    tokens = sharding.shard_batch(jax.numpy.zeros((8, 33), jax.numpy.int32), mesh)
    start = time.perf_counter()
    compiled = sharded_train_step.lower(mesh, state, tokens).compile().compiled
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    inside, outside = all_gathers(compiled.as_text())
    params = sum(a.size for a in jax.tree.leaves(eqx.filter(state.model, eqx.is_array)))
    del state
    return {
        "mesh": mesh_spec,
        "layers": layers,
        "params M": params / 1e6,
        "temp MB": memory.temp_size_in_bytes / MB,
        "arguments MB": memory.argument_size_in_bytes / MB,
        "all-gathers in loop": inside,
        "all-gathers outside": outside,
        "compile s": seconds,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny512", choices=tuple(MODELS))
    parser.add_argument("--layers", default="2,4,8,16")
    parser.add_argument("--meshes", nargs="+", default=["fsdp=8", "fsdp=4,expert=2"])
    parser.add_argument("--name", default="fsdp_memory_cpu8", help="results file name")
    parser.add_argument("--label", default="", help="what code was measured (e.g. 'before')")
    args = parser.parse_args()
    rows = []
    for spec in args.meshes:
        for layers in map(int, args.layers.split(",")):
            rows.append(measure(args.model, spec, layers))
            print(rows[-1], flush=True)
    print_table(rows, f"sharded train step, per device ({args.label or 'this commit'})")
    for spec in args.meshes:
        by = {r["layers"]: r["temp MB"] for r in rows if r["mesh"] == spec}
        if 4 in by and 16 in by:
            print(f"{spec}: temp at 16 layers / at 4 layers = {by[16] / by[4]:.2f}")
    root = pathlib.Path(__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    command = ["python benchmarks/bench_fsdp_memory.py", "--model", args.model]
    command += ["--layers", args.layers, "--meshes"]
    meta = {
        "benchmark": "bench_fsdp_memory.py (sharded step temp memory vs depth)",
        "machine": machine(),
        "commit": commit,
        "label": args.label,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "command": " ".join(command + [f"'{m}'" for m in args.meshes]),
    }
    write_results(root / "benchmarks" / "results", args.name, rows, meta)


if __name__ == "__main__":
    main()
