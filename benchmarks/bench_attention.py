"""Causal attention at MLA's head widths: TFLOP/s of the forward and of forward+backward,
over a dense bf16 matmul of the same FLOPs measured in the same run.

    python benchmarks/bench_attention.py                          # cuDNN, proxy-2b batch 24
    python benchmarks/bench_attention.py --widths 96/64,128/128,64/64 --heads 16

Each width pair is `qk/v` (query-key and value head widths); proxy-2b's 8 heads are 192/128,
DeepSeek-V3's own (16 heads of 96/64 before 2026-12-05: the same FLOPs). FLOPs count the
causal half, c = batch * heads * seq^2: the forward's two matmuls c * (qk + v), the
backward's five (S recomputed, dV, dP, dQ, dK) c * (3 qk + 2 v).
If a width is padded inside the kernel, its TFLOP/s falls below a wider pair's. Times are
CUPTI kernel time on a GPU, wall time elsewhere. `--impl xla` runs JAX's own attention (any
device; what the CPU test uses).
"""

import argparse
import pathlib

import jax
import jax.numpy as jnp
from _timing import kernel_time, median_time, print_table, write_results

from dropless.nn import cudnn_attention


def attention(impl: str):
    """`(q, k, v) -> causal attention` for `impl`: "cudnn" (the library's MLA entry point,
    widths as they are) or "xla" (JAX's reference, value heads zero-padded to the qk width)."""
    if impl == "cudnn":
        return lambda q, k, v: cudnn_attention(q, k, v, q.shape[-1] ** -0.5)

    def xla(q, k, v):
        dv = v.shape[-1]
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - dv)))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return out[..., :dv]

    return xla


def _seconds(fn, *args, repeats):
    if jax.default_backend() == "gpu":
        return kernel_time(fn, *args, iterations=repeats)
    return median_time(fn, *args, repeats=repeats)


def measure(impl, batch, seq, heads, qk, dv, dtype=jnp.bfloat16, repeats=10) -> dict:
    keys = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.random.normal(key, (batch, seq, heads, qk), dtype) for key in keys[:2])
    v = jax.random.normal(keys[2], (batch, seq, heads, dv), dtype)
    cotangent = jax.random.normal(keys[3], (batch, seq, heads, dv), dtype)
    attend = attention(impl)
    forward = jax.jit(attend)

    @jax.jit
    def forward_backward(q, k, v, cotangent):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(cotangent)

    c = batch * heads * seq * seq  # 2 FLOPs a multiply-add, half the scores (causal)
    fwd_flops, both_flops = c * (qk + dv), c * (qk + dv) + c * (3 * qk + 2 * dv)
    # The dense reference: a square bf16 matmul of about the forward's FLOPs.
    n = max(128, round((fwd_flops / 2) ** (1 / 3) / 128) * 128)
    a = jax.random.normal(keys[0], (n, n), dtype)
    dense_rate = 2 * n**3 / _seconds(jax.jit(lambda a: a @ a), a, repeats=repeats)
    t_fwd = _seconds(forward, q, k, v, repeats=repeats)
    t_both = _seconds(forward_backward, q, k, v, cotangent, repeats=repeats)
    return {
        "qk/v": f"{qk}/{dv}",
        "fwd ms": 1e3 * t_fwd,
        "fwd+bwd ms": 1e3 * t_both,
        "fwd TFLOP/s": fwd_flops / t_fwd / 1e12,
        "fwd+bwd TFLOP/s": both_flops / t_both / 1e12,
        "fwd / dense": fwd_flops / t_fwd / dense_rate,
        "fwd+bwd / dense": both_flops / t_both / dense_rate,
        "dense TFLOP/s": dense_rate / 1e12,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="cudnn", choices=("cudnn", "xla"))
    parser.add_argument("--widths", default="192/128,128/128,96/64", help="qk/v pairs")
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/attention"))
    args = parser.parse_args(argv)
    rows = []
    for pair in args.widths.split(","):
        qk, dv = (int(w) for w in pair.split("/"))
        row = measure(args.impl, args.batch, args.seq, args.heads, qk, dv, repeats=args.repeats)
        rows.append(row)
        print_table(rows[-1:])
    title = f"{args.impl} causal attention, batch {args.batch} x {args.seq}, {args.heads} heads"
    print_table(rows, title)
    meta = {"impl": args.impl, "batch": args.batch, "seq": args.seq, "heads": args.heads}
    write_results(args.out, "attention", rows, meta)
    return rows


if __name__ == "__main__":
    main()
