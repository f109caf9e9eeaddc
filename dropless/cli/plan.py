"""`dropless plan`: the command-line front end of `dropless.train.plan.plan`."""

import argparse
import sys
from collections.abc import Sequence

from dropless.cli.config_file import apply_overrides
from dropless.models import get_preset
from dropless.train.config import TrainConfig
from dropless.train.plan.plan import EXCHANGES, FSDP_GATHERS, format_plan, parse_bytes, plan


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
    parser.add_argument("--set", nargs="*", default=[], metavar="model.FIELD=VALUE")
    return parser


def run(args: argparse.Namespace) -> int:
    """Prints the plan of `args` (from `build_parser`); a bad setting is one line on stderr,
    exit 2."""
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
        )
    except ValueError as err:
        print(f"dropless plan: error: {err}", file=sys.stderr)
        return 2
    print(format_plan(p))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`dropless plan ...`: prints the table; the exit status."""
    return run(build_parser().parse_args(argv))
