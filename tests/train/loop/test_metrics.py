"""The JSONL writer and reader."""

import pytest

from dropless.train.loop import metrics


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
