"""The loop's callbacks: the TensorBoard fallback, the progress bar."""

import sys
import time

import jax
import pytest

from dropless.train.loop import _callbacks as callbacks


def test_tensorboard_without_tensorboardx_warns_and_continues(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails
    with pytest.warns(UserWarning, match="pip install tensorboardX"):
        board = callbacks.TensorBoard(str(tmp_path))
    board.on_step({"step": 1, "loss": 1.0})  # a no-op, not an error
    board.on_end(None)


def test_progress_bar_follows_steps(tmp_path):
    out = open(tmp_path / "bar.txt", "w")  # noqa: SIM115
    bar = callbacks.ProgressBar(file=out)
    bar.on_start({"start_step": 2, "steps": 10})
    assert bar._bar.desc.startswith("compiling the first step")
    time.sleep(0.3)  # stands for the first step's compile
    bar.on_step({"step": 3, "loss": 1.0, "max_vio": 0.1, "tokens_per_s": 100.0})
    # the compile is not a step's time: no rate yet, and the clock starts after it
    assert bar._bar.n == 3 and not bar._bar.desc
    assert bar._bar.format_dict["rate"] is None and bar._bar.format_dict["elapsed"] < 0.3
    time.sleep(0.01)
    bar.on_step({"step": 4, "loss": 1.0, "max_vio": 0.1, "tokens_per_s": 100.0})
    assert bar._bar.n == 4 and 0 < bar._bar.format_dict["elapsed"] < 0.3
    bar.on_eval({"step": 3, "loss": 1.0, "ce": 0.9, "max_vio": 0.1})
    bar.on_end(None)
    out.close()
    text = (tmp_path / "bar.txt").read_text()
    assert "eval loss 1.0000" in text and "first step compiled in 0 s" in text


def test_progress_bar_says_when_the_compile_cache_served_the_first_step(tmp_path):
    out = open(tmp_path / "bar.txt", "w")  # noqa: SIM115
    bar = callbacks.ProgressBar(file=out)
    bar.on_start({"start_step": 0, "steps": 10})
    jax.monitoring.record_event(callbacks.COMPILE_CACHE_HIT)
    bar.on_step({"step": 1, "loss": 1.0, "max_vio": 0.1, "tokens_per_s": 100.0})
    jax.monitoring.record_event(callbacks.COMPILE_CACHE_HIT)  # counted no more: no error
    bar.on_end(None)
    out.close()
    assert "first step loaded from the compile cache in 0 s" in (tmp_path / "bar.txt").read_text()
