"""MLA attention's forward+backward: XLA's compiled temp memory and the wall time of the
blockwise strategy against the einsum (XLA) strategy, both compiled and timed in one run.

    python benchmarks/bench_attention_memory.py --seqs 256,1024,4096 --out benchmarks/results

Inputs are MLA's shapes after the projections (DeepSeek-V3's head widths by default: query and
key 128 + 64 with the 64 rope columns of the key shared by every head, values 128), float32
unless `--dtype bfloat16`. "temp" is `compiled.memory_analysis().temp_size_in_bytes` of
`value_and_grad(sum(attention(...) * cotangent))`: what the step needs beside its inputs and
outputs, on this backend (the einsum attention's `[batch heads seq seq]` float32 scores and
probabilities dominate it at long sequences).
"""

import argparse
import pathlib
import subprocess

import jax
import jax.numpy as jnp
from _timing import machine, median_time, print_table, write_results

from dropless.nn import BlockwiseAttention, XlaAttention


def compiled_step(attention, batch, seq, heads, nope, rope, dv, dtype):
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (batch, seq, heads, nope + rope), dtype)
    k_nope = jax.random.normal(keys[1], (batch, seq, heads, nope), dtype)
    k_rope = jax.random.normal(keys[2], (batch, seq, rope), dtype)
    v = jax.random.normal(keys[3], (batch, seq, heads, dv), dtype)
    cotangent = jax.random.normal(keys[4], (batch, seq, heads, dv), jnp.float32)
    scale = (nope + rope) ** -0.5

    def loss(q, k_nope, k_rope, v, cotangent):
        out = attention(q, k_nope, k_rope, v, scale)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    args = (q, k_nope, k_rope, v, cotangent)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile()
    return step, args


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="256,1024,4096")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--widths", default="128/64/128", help="nope/rope/v head widths")
    parser.add_argument("--block", type=int, default=512, help="BlockwiseAttention's tiles")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    nope, rope, dv = (int(w) for w in args.widths.split("/"))
    dtype = jnp.dtype(args.dtype)
    strategies = {"xla": XlaAttention(), "blockwise": BlockwiseAttention(args.block, args.block)}
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        row = {"seq": seq}
        for name, attention in strategies.items():
            shape = (args.batch, seq, args.heads, nope, rope, dv, dtype)
            step, inputs = compiled_step(attention, *shape)
            row[f"{name} temp MB"] = step.memory_analysis().temp_size_in_bytes / 1e6
            row[f"{name} s"] = median_time(step, *inputs, repeats=args.repeats, warmup=1)
        row["temp blockwise / xla"] = row["blockwise temp MB"] / row["xla temp MB"]
        row["time blockwise / xla"] = row["blockwise s"] / row["xla s"]
        rows.append(row)
        print_table(rows[-1:])
    title = (
        f"MLA attention fwd+bwd, batch {args.batch}, {args.heads} heads of {nope}+{rope}/{dv}, "
        f"{args.dtype}, blocks {args.block}; {machine()}"
    )
    print_table(rows, title)
    if args.out is not None:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        meta = {
            "benchmark": "attention_memory",
            "machine": machine(),
            "commit": commit,
            "command": "python benchmarks/bench_attention_memory.py "
            f"--seqs {args.seqs} --batch {args.batch} --heads {args.heads} --widths {args.widths} "
            f"--block {args.block} --dtype {args.dtype} --repeats {args.repeats}",
            "setup": title,
        }
        write_results(args.out, "attention_memory_cpu", rows, meta)
    return rows


if __name__ == "__main__":
    main()
