"""Train-step throughput and MFU of a DeepSeek-V3 preset, per backend.

    python benchmarks/bench_train.py --preset proxy-2b --backends te,jnp-capacity,jnp
    python benchmarks/bench_train.py --preset proxy-2b --backends pallas --against loss_chunk=8192

From a script, `compare(config, backend, {name: variant, ...})` times variants of the step in
one process, each a context (see `patched`) or keyword arguments for `bench` (its docstring).

Model FLOPs per token = 6 x (active matmul parameters: active params without the input
embedding, plus the MTP modules' active params and their pass through the shared head)
+ attention (QK^T and AV, 2 * seq * heads * (qk_head_dim + v_head_dim) per token per layer
forward, causal mask not discounted, times 3 for forward + backward).
MFU = model FLOP/s over --peak (989 TFLOP/s: H200 dense bf16, datasheet).
"""

import argparse
import contextlib
import os
import pathlib
import statistics
import time

import _profile
import jax
from _timing import machine, print_table, write_results

from dropless.backends import BackendUnavailableError
from dropless.cli import apply_overrides
from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config, count_params, get_preset
from dropless.train import TrainConfig, get_backend, init_state, train_step

SCOPES_BY_OP = 12  # --profile lists the kernels by op of this many of the costliest scopes
# JAX preallocates this fraction of the GPU's memory, 75% by default (newer jaxlib reads
# XLA_CLIENT_MEM_FRACTION, the older name still works).
MEMORY_FRACTION = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")
OUT_OF_MEMORY_HINT = (
    "JAX took 75% of the GPU's memory (its default): with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 "
    "(or XLA_CLIENT_MEM_FRACTION, not both) proxy-2b trains at batch 24 x 2048 in one pass on "
    "an H200"
)


COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="


def without_command_buffers(xla_flags: str) -> str:
    """`xla_flags` with XLA's GPU command buffers off, for --profile: with them on, a step's
    kernels run inside one command buffer and the profile cannot put them in their scopes
    (seen on an H200: with them on, the profile's scopes come out empty)."""
    kept = [f for f in xla_flags.split() if not f.startswith("--xla_gpu_enable_command_buffer")]
    return " ".join([*kept, COMMAND_BUFFERS_OFF])


def flops_per_token(config, seq: int) -> float:
    counts = count_params(config)
    depth = config.num_nextn_predict_layers
    head = counts.head or counts.embedding  # a tied head reuses the embedding matrix
    matmul_params = counts.active - counts.embedding + counts.mtp_active + depth * head
    layers = config.num_hidden_layers + depth
    attention = 2 * seq * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    return 6 * matmul_params + 3 * layers * attention


def bench(
    config,
    backend,
    batch,
    seq,
    steps,
    profile_to=None,
    profile_top=25,
    micro_batches=1,
    moments_dtype="float32",
):
    """Median step time and last loss; with `profile_to`, also print where the time goes.
    `micro_batches`: the step's gradient in that many passes (gradient accumulation);
    `moments_dtype`: AdamW's moments' storage (`TrainConfig.moments_dtype`)."""
    model = DeepSeekV3(config, backend=get_backend(backend), key=jax.random.key(0))
    train_config = TrainConfig(steps=1000, warmup_steps=10, moments_dtype=moments_dtype)
    state = init_state(model, train_config)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, config.vocab_size)
    hlo = (
        train_step.lower(state, tokens, micro_batches).compile().compiled.as_text()
        if profile_to
        else ""
    )
    state, metrics = train_step(state, tokens, micro_batches)  # compile
    jax.block_until_ready(metrics["loss"])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = train_step(state, tokens, micro_batches)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    if profile_to is not None:

        def run():
            nonlocal state, metrics
            state, metrics = train_step(state, tokens, micro_batches)
            jax.block_until_ready(metrics["loss"])

        scopes, all_kernels = _profile.profile(
            run, hlo, trace_copy=profile_to.with_suffix(".json.gz"), top=None
        )
        print_table(scopes, f"{backend}: device time per step by scope")
        kernels = all_kernels[:profile_top]
        print_table(kernels, f"{backend}: top kernels")
        by_op = _profile.ops_by_scope(all_kernels, hlo)
        for row in scopes[:SCOPES_BY_OP]:
            print_table(by_op[row["scope"]], f"{row['scope']}: kernels by op, layers merged")
        write_results(
            profile_to.parent, profile_to.name, scopes + kernels, {"backend": str(backend)}
        )
    return statistics.median(times), float(metrics["loss"])


def out_of_gpu_memory(err: Exception) -> bool:
    """Whether `err` is a GPU out-of-memory error under JAX's default memory fraction."""
    return (
        "RESOURCE_EXHAUSTED" in str(err)
        and jax.default_backend() == "gpu"
        and not any(map(os.getenv, MEMORY_FRACTION))
    )


@contextlib.contextmanager
def patched(owner, name: str, value):
    """`owner.name = value` inside the block, restored after it: how a variant swaps in a piece
    of code (e.g. `patched(routing, "_top_k", lax_top_k)`)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def compare(config, backend, variants, batch=8, seq=2048, steps=8, peak=989e12) -> list[dict]:
    """Same-process A/B of the train step: for each `name: variant` of `variants`, JAX's
    caches cleared (else a variant reuses the previous one's compiled step), the step compiled
    and timed. A variant is either a function returning a context (`patched(...)`) that the
    step runs inside, or a dict of keyword arguments for `bench` (`{"moments_dtype":
    "bfloat16"}`; `{"backend": ...}` replaces `backend`; `{"set": ["loss_chunk=8192"]}` changes
    the model config as `--set` does, MFU then counted on that config). Prints one `== name:
    ...` line per variant as it ends and returns the rows. Across processes the same code varies
    by up to 3% on an H200, so only variants of one call compare."""
    rows = []
    for name, variant in variants.items():
        make_context, options = (
            (contextlib.nullcontext, dict(variant)) if isinstance(variant, dict) else (variant, {})
        )
        chosen = options.pop("backend", backend)
        changed = with_overrides(config, options.pop("set", []))
        jax.clear_caches()
        start = time.perf_counter()
        with make_context():
            t, loss = bench(changed, chosen, batch, seq, steps, **options)
        tokens_per_s = batch * seq / t
        row = {
            "variant": name,
            "step s": t,
            "tokens/s": tokens_per_s,
            "MFU": flops_per_token(changed, seq) * tokens_per_s / peak,
            "loss": loss,
            "s to the first step": time.perf_counter() - start - (steps + 1) * t,
        }
        rows.append(row)
        print(
            f"== {name}: step {t:.4f} s, {tokens_per_s:,.0f} tokens/s, MFU {row['MFU']:.1%}, "
            f"loss {loss:.3f}, {row['s to the first step']:.0f} s to the first step",
            flush=True,
        )
    return rows


def with_overrides(config: DeepSeekV3Config, items: list[str]) -> DeepSeekV3Config:
    """`config` with `["field=value", ...]` applied as `dropless train --set model.field=value`
    applies them (values read as YAML, numbers and None as the fields want, unknown fields
    named), so the two commands read an override alike."""
    if not items:
        return config
    model, _ = apply_overrides(config, TrainConfig(), [f"model.{item}" for item in items])
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="proxy-2b")
    parser.add_argument("--backends", default="te,jnp-capacity,jnp")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--micro-batches", type=int, default=1, help="gradient accumulation: passes per step"
    )
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peak", type=float, default=989e12, help="peak FLOP/s for MFU")
    parser.add_argument("--compute-dtype", default="bfloat16")
    parser.add_argument("--remat", default="none")
    parser.add_argument("--attention-impl", default="xla", choices=("xla", "blockwise", "cudnn"))
    parser.add_argument("--unroll-layers", action="store_true", help="unroll the layer scan")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="model config overrides, read as `dropless train --set model.FIELD=VALUE` reads them",
    )
    parser.add_argument(
        "--moments-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="storage dtype of AdamW's moments",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print device time per scope and its kernels by op (turns XLA's GPU command "
        "buffers off, which would hide the scopes)",
    )
    parser.add_argument("--profile-top", type=int, default=25, help="kernels listed by --profile")
    parser.add_argument(
        "--against",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="A/B in one process (`compare`): the step as configured, then with these model "
        "overrides too, for each backend",
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/bench_train"))
    args = parser.parse_args()
    if args.profile:  # read when JAX starts its GPU backend, which no import above has done
        os.environ["XLA_FLAGS"] = without_command_buffers(os.environ.get("XLA_FLAGS", ""))
    names = args.backends.split(",")
    if any(n.startswith("te") for n in names):  # TE loads before JAX's GPU backend (cuDNN)
        try:
            # TE's early load is an internal of the private `_te` module.
            from dropless.backends import _te as te

            te.load_te()
        except BackendUnavailableError as err:
            print("te unavailable:", err)
    config = get_preset(
        args.preset,
        compute_dtype=args.compute_dtype,
        remat=args.remat,
        unroll_layers=args.unroll_layers,
        attention_impl=args.attention_impl,
    )
    try:
        config = with_overrides(config, args.set)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    per_token = flops_per_token(config, args.seq)
    tokens = args.batch * args.seq
    meta = {
        "machine": machine(),
        "preset": args.preset,
        "batch": args.batch,
        "micro_batches": args.micro_batches,
        "seq": args.seq,
        "remat": args.remat,
        "unroll_layers": args.unroll_layers,
        "attention": args.attention_impl,
        "moments": args.moments_dtype,
        **({"set": args.set} if args.set else {}),
    }
    print(meta, f"model GFLOP/token {per_token / 1e9:.2f}")
    if args.against:
        options = {"micro_batches": args.micro_batches, "moments_dtype": args.moments_dtype}
        variants = {"as set": options, " ".join(args.against): {**options, "set": args.against}}
        for name in names:
            print(f"{name}:")
            compare(config, name, variants, args.batch, args.seq, args.steps, args.peak)
        return
    rows = []
    for name in names:
        try:
            profile_to = args.out / f"profile_{args.preset}_{name}" if args.profile else None
            t, loss = bench(
                config,
                name,
                args.batch,
                args.seq,
                args.steps,
                profile_to,
                args.profile_top,
                args.micro_batches,
                args.moments_dtype,
            )
        except BackendUnavailableError as err:
            rows.append({"backend": name, "status": f"unavailable: {err}"[:100]})
            continue
        except Exception as err:  # noqa: BLE001 -- report OOM and go on
            rows.append({"backend": name, "status": f"error: {str(err)[:120]}"})
            if out_of_gpu_memory(err):
                print(OUT_OF_MEMORY_HINT)
            continue
        rows.append(
            {
                "backend": name,
                "status": "ok",
                "step s": t,
                "tokens/s": tokens / t,
                "model TFLOP/s": per_token * tokens / t / 1e12,
                "MFU": per_token * tokens / t / args.peak,
                "loss": loss,
            }
        )
        print_table(rows[-1:])
    print_table(rows, f"{args.preset}, batch {args.batch} x {args.seq}, {config.compute_dtype}")
    tag = f"{args.preset}_b{args.batch}m{args.micro_batches}_{args.remat}_{args.attention_impl}"
    tag += "_unrolled" if args.unroll_layers else ""
    tag += "_bf16moments" if args.moments_dtype == "bfloat16" else ""
    tag += "".join(f"_{item.replace('=', '')}" for item in args.set)
    write_results(args.out, f"train_{tag}", rows, meta)


if __name__ == "__main__":
    main()
