"""The loop's callbacks: the TensorBoard fallback, the progress bar."""

import sys

import pytest

from dropless.train.loop import callbacks


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
    bar.on_step({"step": 3, "loss": 1.0, "max_vio": 0.1, "tokens_per_s": 100.0})
    bar.on_eval({"step": 3, "loss": 1.0, "ce": 0.9, "max_vio": 0.1})
    assert bar._bar.n == 3
    bar.on_end(None)
    out.close()
    text = (tmp_path / "bar.txt").read_text()
    assert "eval loss 1.0000" in text
