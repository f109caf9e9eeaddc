"""The JSONL writer and reader."""

import errno
import os

import pytest

from dropless.train.loop import _metrics as metrics


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


def test_a_full_disk_leaves_no_torn_line(tmp_path, monkeypatch):
    """Issue 53 row 11: a metrics write that runs out of space half-way is one line naming the
    file, and the file keeps whole lines only."""
    path = tmp_path / "metrics.jsonl"
    writer = metrics.MetricsWriter(str(path))
    writer.write({"split": "train", "step": 1})
    real = os.write

    def full(fd, data):
        real(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics.os, "write", full)
    with pytest.raises(OSError, match=r"no space left on the device of .*metrics\.jsonl \(.* free"):
        writer.write({"split": "train", "step": 2, "loss": 1.5})
    monkeypatch.undo()
    writer.close()
    assert path.read_text() == '{"split": "train", "step": 1}\n'
