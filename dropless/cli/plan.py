"""`dropless plan`: the command-line front end of `dropless.train.plan.plan`."""

import argparse
import sys
from collections.abc import Sequence

import jax

from dropless.cli.config_file import apply_overrides
from dropless.models import get_preset
from dropless.train.config import TrainConfig
from dropless.train.plan.compile import (
    GPU_COMPILER_OPTIONS,
    GPUS,
    PluginMissingError,
    check_plugin,
    compiled_memory,
    gpu_devices,
)
from dropless.train.plan.plan import (
    EXCHANGES,
    FSDP_GATHERS,
    MFU,
    PEAK_FLOPS,
    format_plan,
    parse_bytes,
    plan,
    train_config,
)

GPU_NAMES = tuple(GPUS)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of `plan`, added to `parser` (a new one if None)."""
    parser = parser or argparse.ArgumentParser(
        prog="dropless plan",
        description="Per-device memory, FLOPs and all-to-all traffic of a training step.",
    )
    parser.add_argument("--preset", required=True)
    parser.add_argument("--mesh", default="", help="e.g. fsdp=16,expert=8 (default: one device)")
    parser.add_argument("--batch-size", type=int, required=True, help="global sequences")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--remat", default=None, help="none | full | dots | dots_no_batch")
    parser.add_argument("--moments-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--offload-optimizer", action="store_true")
    parser.add_argument("--device-memory", default=None, help="e.g. 141GB, 192GiB, bytes")
    parser.add_argument("--recv-factor", type=float, default=None)
    parser.add_argument("--exchange", default="ragged", choices=EXCHANGES)
    parser.add_argument("--fsdp-gather", default="step", choices=FSDP_GATHERS)
    parser.add_argument("--mfu", type=float, default=MFU, help="for the compute time")
    parser.add_argument(
        "--peak-tflops", type=float, default=PEAK_FLOPS / 1e12, help="per device, for the MFU"
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="H200",
        default=None,
        metavar="GPU",
        help=f"also compile the real train step for the mesh on GPUs ({', '.join(GPU_NAMES)}; "
        "default H200) without one, and print XLA's per-GPU memory beside the plan's "
        "(needs JAX's CUDA PJRT plugin)",
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="model.FIELD=VALUE")
    return parser


def run(args: argparse.Namespace) -> int:
    """Prints the plan of `args` (from `build_parser`); a bad setting is one line on stderr,
    exit 2."""
    if args.compile is not None:
        try:
            if args.compile not in GPU_NAMES:
                raise ValueError(f"--compile ({args.compile!r}) must be one of {GPU_NAMES}")
            check_plugin()
        except (ValueError, PluginMissingError) as err:
            print(f"dropless plan: error: {err}", file=sys.stderr)
            return 2
        # before any backend starts: the CUDA plugin then skips its driver check (no GPU here)
        # and still compiles for the GPU topology
        jax.config.update("jax_platforms", "cpu")
    try:
        config, _ = apply_overrides(get_preset(args.preset), TrainConfig(), args.set)
        memory = None if args.device_memory is None else parse_bytes(args.device_memory)
        p = plan(
            config,
            args.mesh,
            args.batch_size,
            args.seq_len,
            micro_batches=args.micro_batches,
            remat=args.remat,
            moments_dtype=args.moments_dtype,
            offload_optimizer=args.offload_optimizer,
            device_memory=memory,
            recv_factor=args.recv_factor,
            exchange=args.exchange,
            fsdp_gather=args.fsdp_gather,
            mfu=args.mfu,
            peak_flops=args.peak_tflops * 1e12,
        )
    except ValueError as err:
        print(f"dropless plan: error: {err}", file=sys.stderr)
        return 2
    print(format_plan(p), flush=True)
    if args.compile is not None:
        return _compile(args, config, p)
    return 0


def _compile(args: argparse.Namespace, config, p) -> int:
    """Compiles the step for `args.compile` GPUs and prints XLA's figure beside the plan's."""
    train = train_config(args.batch_size, args.seq_len, args.micro_batches, args.moments_dtype)
    if args.remat is not None:
        config = config.replace(remat=args.remat)
    if config.attention_impl == "cudnn":
        # cuDNN's attention asks the cuDNN library for its version while tracing; the blockwise
        # attention keeps the same residuals (the output and a float32 statistic per row)
        print("attention 'cudnn' is compiled as 'blockwise' (the same residuals; no cuDNN here)")
        config = config.replace(attention_impl="blockwise")
    devices = gpu_devices(args.compile, p.devices)
    print(f"compiling the train step for {p.devices} x {devices[0].device_kind} ...", flush=True)
    m = compiled_memory(config, train, args.mesh, devices, GPU_COMPILER_OPTIONS)
    gb = 1e9
    print(
        f"XLA / GPU  {m.total / gb:.2f} GB (arguments {m.arguments / gb:.2f}, outputs "
        f"{m.outputs / gb:.2f}, aliased {m.aliased / gb:.2f}, temp {m.temp / gb:.2f}; "
        f"compiled in {m.seconds:.0f} s)"
    )
    print(f"plan / XLA {p.total / m.total:.3f} ({p.total / gb:.2f} GB against {m.total / gb:.2f})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`dropless plan ...`: prints the table; the exit status."""
    return run(build_parser().parse_args(argv))
