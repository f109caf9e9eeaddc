"""The planning wing of `dropless.train`: per-device memory, FLOPs and all-to-all traffic of a
training step on a mesh, without allocating the model (`dropless plan`).

It imports the step wing and `dropless.sharding`, not the loop or run storage."""

from dropless.train.plan._attention import traced_without_cudnn
from dropless.train.plan._compile import PluginMissingError, check_plugin, compiled_memory
from dropless.train.plan._plan import (
    EXCHANGES,
    FSDP_GATHERS,
    LINKS,
    MFU,
    PEAK_FLOPS,
    Plan,
    flops_per_token,
    format_plan,
    parse_bytes,
    plan,
    train_config,
)

__all__ = [
    "EXCHANGES",
    "FSDP_GATHERS",
    "LINKS",
    "MFU",
    "PEAK_FLOPS",
    "Plan",
    "PluginMissingError",
    "check_plugin",
    "compiled_memory",
    "flops_per_token",
    "format_plan",
    "parse_bytes",
    "plan",
    "train_config",
    "traced_without_cudnn",
]
