"""JSONL writer/reader, plots, TensorBoard fallback."""

import sys
import time

import jax
import numpy as np
import pytest

from dropless.train import metrics


def test_writer_keeps_records_up_to_the_resumed_step(tmp_path):
    path = str(tmp_path / "m.jsonl")
    writer = metrics.MetricsWriter(path)
    for step in range(1, 6):
        writer.write({"split": "train", "step": step, "loss": 1.0 / step})
    writer.close()
    with open(path, "a") as f:
        f.write('{"split": "train", "st')  # a torn line from a killed run
    writer = metrics.MetricsWriter(path, keep_until=3)
    writer.write({"split": "train", "step": 4, "loss": 0.0})
    writer.close()
    records = metrics.read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["loss"] == 0.0
    assert metrics.MetricsWriter(path).close() is None and metrics.read_jsonl(path) == []


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plots_are_written(tmp_path):
    records = [
        {"split": "train", "step": s, "loss": 5 / s, "ce": 4 / s, "max_vio": 0.5 / s}
        for s in range(1, 30)
    ] + [{"split": "eval", "step": 10, "loss": 0.6}, {"split": "eval", "step": 29, "loss": 0.2}]
    metrics.plot_loss(records, str(tmp_path / "loss.png"))
    load = np.random.default_rng(0).uniform(50, 150, (4, 16))
    metrics.plot_expert_load(load, str(tmp_path / "load.png"), layer_names=["1", "2", "3", "mtp0"])
    for name in ("loss.png", "load.png"):
        assert _is_png(tmp_path / name) and (tmp_path / name).stat().st_size > 10_000


def test_tensorboard_without_tensorboardx_warns_and_continues(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails
    with pytest.warns(UserWarning, match="pip install tensorboardX"):
        board = metrics.TensorBoard(str(tmp_path))
    board.on_step({"step": 1, "loss": 1.0})  # a no-op, not an error
    board.on_end(None)


def test_progress_bar_follows_steps(tmp_path):
    out = open(tmp_path / "bar.txt", "w")  # noqa: SIM115
    bar = metrics.ProgressBar(file=out)
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
    bar = metrics.ProgressBar(file=out)
    bar.on_start({"start_step": 0, "steps": 10})
    jax.monitoring.record_event(metrics.COMPILE_CACHE_HIT)
    bar.on_step({"step": 1, "loss": 1.0, "max_vio": 0.1, "tokens_per_s": 100.0})
    jax.monitoring.record_event(metrics.COMPILE_CACHE_HIT)  # counted no more: no error
    bar.on_end(None)
    out.close()
    assert "first step loaded from the compile cache in 0 s" in (tmp_path / "bar.txt").read_text()


def test_a_kill_while_resuming_never_loses_the_history(tmp_path, monkeypatch):
    """The resumed writer rewrites the kept records: a failure part-way (a kill) leaves the
    old file whole, not truncated."""
    path = str(tmp_path / "m.jsonl")
    writer = metrics.MetricsWriter(path)
    for step in range(1, 6):
        writer.write({"split": "train", "step": step})
    writer.close()
    before = (tmp_path / "m.jsonl").read_text()
    real_dumps, calls = metrics.json.dumps, []

    def dies_on_the_second_record(record):
        calls.append(record)
        if len(calls) == 2:
            raise KeyboardInterrupt  # stands for SIGKILL mid-rewrite
        return real_dumps(record)

    monkeypatch.setattr(metrics.json, "dumps", dies_on_the_second_record)
    with pytest.raises(KeyboardInterrupt):
        metrics.MetricsWriter(path, keep_until=3)
    monkeypatch.undo()
    assert (tmp_path / "m.jsonl").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]  # no temporary left
