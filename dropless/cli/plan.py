"""`dropless plan`: the command-line front end of `dropless.train.plan`."""

import dataclasses
from typing import Literal

from dropless.cli.config_file import apply_overrides
from dropless.models.deepseek_v3 import get_preset
from dropless.train.config import TrainConfig
from dropless.train.plan import EXCHANGES, FSDP_GATHERS, format_plan, parse_bytes, plan

# What the verdict is against without --device-memory: an H200's memory, the GPU the project's
# large runs use.
ASSUMED_DEVICE = ("an H200", "141GB")


@dataclasses.dataclass(frozen=True)
class PlanCommand:
    """Per-device memory, FLOPs and all-to-all traffic of a training step, and whether it fits
    the device's memory, without allocating the model."""

    preset: str
    """The model preset (`dropless presets` lists them)."""
    batch_size: int
    """Global sequences per step."""
    seq_len: int
    """Tokens per sequence."""
    mesh: str = ""
    """Device mesh, e.g. fsdp=16,expert=8 (default: one device)."""
    micro_batches: int = 1
    """Gradient-accumulation passes per step."""
    remat: Literal["none", "full", "dots", "dots_no_batch"] | None = None
    """Rematerialisation per layer (default: the preset's)."""
    moments_dtype: Literal["float32", "bfloat16"] = "float32"
    """AdamW moments' dtype."""
    offload_optimizer: bool = False
    """Keep the AdamW moments in host memory."""
    device_memory: str | None = None
    """Memory per device for the verdict, e.g. 141GB, 192GiB, or bytes (default: 141GB, an
    H200's)."""
    recv_factor: float | None = None
    """Expert-parallel receive buffer, as a multiple of the balanced share."""
    exchange: Literal[EXCHANGES] = "ragged"  # type: ignore[valid-type]
    """Expert-parallel token exchange."""
    fsdp_gather: Literal[FSDP_GATHERS] = "step"  # type: ignore[valid-type]
    """FSDP: gather the weights once per step or per layer."""
    set: tuple[str, ...] = ()
    """Dotted overrides in YAML: --set model.compute_dtype=bfloat16."""


def run(args: PlanCommand) -> int:
    """Prints the plan of `args`; a bad setting raises ValueError (one line, exit 2)."""
    config, _ = apply_overrides(get_preset(args.preset), TrainConfig(), args.set)
    assumed = args.device_memory is None
    memory = parse_bytes(ASSUMED_DEVICE[1] if assumed else args.device_memory)
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
    text = format_plan(p)
    if assumed:
        text += f" ({ASSUMED_DEVICE[0]}'s, assumed; --device-memory sets another)"
    print(text)
    return 0
