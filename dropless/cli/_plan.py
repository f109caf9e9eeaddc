"""`dropless plan`: the command-line front end of `dropless.train.plan`."""

import dataclasses
from typing import Literal

import jax

from dropless.cli._config_file import apply_overrides
from dropless.models import get_preset
from dropless.train._config import TrainConfig
from dropless.train.plan._attention import traced_without_cudnn
from dropless.train.plan._compile import (
    GPU_COMPILER_OPTIONS,
    GPUS,
    PluginMissingError,
    check_plugin,
    compiled_memory,
    gpu_devices,
)
from dropless.train.plan._plan import (
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
    fsdp_gather: Literal[FSDP_GATHERS] = "layer"  # type: ignore[valid-type]
    """FSDP: per layer (what the step does) or the whole model at once (for comparison)."""
    mfu: float = MFU
    """MFU of the compute time that the network time is set against."""
    peak_tflops: float = PEAK_FLOPS / 1e12
    """Peak bf16 TFLOP/s per device, for the MFU."""
    compile: Literal[GPU_NAMES] | None = None  # type: ignore[valid-type]
    """Also compile the train step for these GPUs (no GPU needed) and print XLA's figure."""
    set: tuple[str, ...] = ()
    """Dotted overrides in YAML: --set model.compute_dtype=bfloat16."""


def run(args: PlanCommand) -> int:
    """Prints the plan of `args`; a bad setting raises ValueError (one line, exit 2)."""
    if args.compile is not None:
        try:
            check_plugin()
        except PluginMissingError as err:
            raise ValueError(str(err)) from None
        # before any backend starts: the CUDA plugin then skips its driver check (no GPU here)
        # and still compiles for the GPU topology
        jax.config.update("jax_platforms", "cpu")
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
        mfu=args.mfu,
        peak_flops=args.peak_tflops * 1e12,
    )
    text = format_plan(p)
    if assumed:
        text += f" ({ASSUMED_DEVICE[0]}'s, assumed; --device-memory sets another)"
    print(text, flush=True)
    if args.compile is not None:
        return _compile(args, config, p)
    return 0


def _compile(args: PlanCommand, config, p) -> int:
    """Compiles the step for `args.compile` GPUs and prints XLA's figure beside the plan's."""
    train = train_config(args.batch_size, args.seq_len, args.micro_batches, args.moments_dtype)
    if args.remat is not None:
        config = config.replace(remat=args.remat)
    if config.attention_impl == "cudnn":
        config = traced_without_cudnn(config)
        print(
            f"attention 'cudnn' is compiled as {config.attention_impl!r} (no cuDNN here; "
            "dropless.train.plan._attention.traced_without_cudnn says what that keeps)"
        )
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
