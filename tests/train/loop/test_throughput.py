"""Throughput: MFU against a known peak, the table of peaks, the interval timer and the run
summary's medians."""

import time

import jax
import pytest

from dropless.models.deepseek_v3 import get_preset
from dropless.train import TrainConfig
from dropless.train.loop._throughput import Throughput, device_peak, meter, mfu, peak_flops, summary
from dropless.train.plan import flops_per_token


def test_mfu_is_model_flops_over_time_over_peak():
    # 2e12 FLOPs in 0.5 s is 4e12 FLOP/s: half of an 8e12 peak, a quarter of two such devices
    assert mfu(2e12, 0.5, 8e12) == pytest.approx(0.5)
    assert mfu(2e12, 0.5, 8e12, devices=2) == pytest.approx(0.25)
    assert mfu(2e12, 0.5, None) is None  # unknown peak (a CPU)


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GB200", 2.5e15),
        ("NVIDIA GB300", 2.5e15),
        ("Tesla T4", None),
    ],
)
def test_peak_flops_by_device_kind(kind, peak):
    assert peak_flops(kind) == peak


def test_no_peak_on_a_cpu():
    if jax.devices()[0].platform != "cpu":
        pytest.skip("runs on a CPU")
    assert device_peak() is None


def test_meter_counts_the_steps_of_an_interval():
    config = get_preset("tiny")
    train_config = TrainConfig(batch_size=4, seq_len=16)
    timer = meter(config, train_config)
    assert timer.tokens_per_step == 64
    assert timer.flops_per_step == pytest.approx(64 * flops_per_token(config, 16))

    timer = Throughput(tokens_per_step=100, flops_per_step=1e9, peak=1e10)
    timer.mark()
    time.sleep(0.05)
    rate, one = timer.lap()
    time.sleep(0.05)
    rate2, two = timer.lap()  # two steps in about 0.1 s: about the same rate per step
    assert 0 < rate <= 100 / 0.05 and 0 < rate2 <= 100 / 0.05
    # MFU is tokens/s times FLOPs per token over the peak
    assert two == pytest.approx(rate2 * (1e9 / 100) / 1e10)
    timer.mark()
    assert timer.lap()[0] > rate2  # a new interval: no sleep in it


def test_summary_is_the_median_after_the_first_step():
    records = [
        {"split": "train", "step": 1, "tokens_per_s": 1.0, "mfu": 0.01},
        {"split": "train", "step": 2, "tokens_per_s": 100.0, "mfu": 0.3},
        {"split": "eval", "step": 2, "loss": 1.0},
        {"split": "train", "step": 3, "tokens_per_s": 300.0, "mfu": 0.5},
        {"split": "train", "step": 4, "tokens_per_s": 200.0, "mfu": 0.4},
    ]
    assert summary(records) == {"tokens_per_s": 200.0, "mfu": 0.4}
    cpu = [{**r, "mfu": None} for r in records if r["split"] == "train"]
    assert summary(cpu) == {"tokens_per_s": 200.0, "mfu": None}
    assert summary(records[:1]) == {"tokens_per_s": 1.0, "mfu": 0.01}  # one step: itself
    assert summary([]) == {"tokens_per_s": None, "mfu": None}
