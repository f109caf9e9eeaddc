"""Throughput of a run: training tokens per second and model FLOPs utilisation (MFU).

`tokens_per_s` is wall-clock throughput: the training tokens of a logging interval over the
wall time from the end of the previous logged step's evaluation and checkpoint (neither counts)
to the end of the interval's last step, data loading and host work included. The
first step of a run, which compiles, is an interval of its own. MFU = model FLOPs per step
(`dropless.train.plan.flops_per_token` times the tokens of a step) per step of that wall time,
over the devices' peak dense bf16 FLOP/s; None where the peak is unknown (a CPU, an unlisted
GPU).
"""

import dataclasses
import statistics
import time
from collections.abc import Iterable

import jax

from dropless.models.deepseek_v3 import DeepSeekV3Config
from dropless.train._config import TrainConfig
from dropless.train.plan._plan import flops_per_token

# Peak dense (not 2:4 sparse) bf16 tensor-core FLOP/s of one GPU, from NVIDIA's datasheets:
# A100 (SXM and PCIe): 312 TFLOP/s (A100 datasheet, "BFLOAT16 Tensor Core 312 TFLOPS | 624*",
# * with sparsity). H100 SXM 989, PCIe 756, NVL 835 TFLOP/s (H100 datasheet: 1,979 / 1,513 /
# 1,671 with sparsity). H200 SXM 989, NVL 835 TFLOP/s (H200 datasheet: 1,979 / 1,671 with
# sparsity). GB200 and GB300: 2.5 PFLOP/s per Blackwell GPU (NVL72 datasheets: 360 PFLOP/s
# FP16/BF16 with sparsity over 72 GPUs). Matched in this order against the lower-cased
# `device_kind`, so the more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("gb300", 2.5e15),
    ("gb200", 2.5e15),
    ("h200 nvl", 835e12),
    ("h200", 989e12),
    ("h100 nvl", 835e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("a100", 312e12),
)


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of a GPU of this `device_kind` (`jax.Device.device_kind`), from
    `PEAK_BF16_FLOPS`; None if unlisted."""
    kind = device_kind.lower()
    return next((peak for name, peak in PEAK_BF16_FLOPS if name in kind), None)


def device_peak(device: jax.Device | None = None) -> float | None:
    """`peak_flops` of `device` (default: the first device); None for a CPU or TPU."""
    device = device or jax.devices()[0]
    return peak_flops(device.device_kind) if device.platform == "gpu" else None


def mfu(flops_per_step: float, step_time: float, peak: float | None, devices: int = 1):
    """Model FLOPs utilisation: `flops_per_step` done in `step_time` seconds, over the peak
    of `devices` devices of `peak` FLOP/s each; None without a peak."""
    if peak is None or step_time <= 0:
        return None
    return flops_per_step / step_time / (peak * devices)


@dataclasses.dataclass
class Throughput:
    """Times logging intervals: `lap(steps)` after each step gives that step's (tokens_per_s,
    mfu) over the interval since the last `mark()` (or since the start of the first step)."""

    tokens_per_step: int
    flops_per_step: float
    peak: float | None
    devices: int = 1
    _since: float = dataclasses.field(default_factory=time.perf_counter)
    _steps: int = 0

    def lap(self) -> tuple[float, float | None]:
        """Counts a finished step; (tokens/s, MFU) over the steps of the open interval."""
        self._steps += 1
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        per_step = elapsed / self._steps
        return self.tokens_per_step / per_step, mfu(
            self.flops_per_step, per_step, self.peak, self.devices
        )

    def mark(self) -> None:
        """Starts a new interval now (after a record is logged, and after the first step)."""
        self._since, self._steps = time.perf_counter(), 0


def meter(model_config: DeepSeekV3Config, train_config: TrainConfig, devices: int = 1):
    """A `Throughput` for steps of `train_config`'s batch on `devices` devices of this kind."""
    tokens = train_config.batch_size * train_config.seq_len
    flops = flops_per_token(model_config, train_config.seq_len) * tokens
    return Throughput(tokens, flops, device_peak(), devices)


def summary(records: Iterable[dict]) -> dict:
    """Median tokens/s and MFU over the training records after the first (the first compiles);
    the first alone when it is the only one. MFU is None where the records have none."""
    records = [r for r in records if r.get("split") == "train" and "tokens_per_s" in r]
    later = records[1:] or records
    rates = [r["tokens_per_s"] for r in later]
    mfus = [r["mfu"] for r in later if r.get("mfu") is not None]
    return {
        "tokens_per_s": statistics.median(rates) if rates else None,
        "mfu": statistics.median(mfus) if mfus else None,
    }
