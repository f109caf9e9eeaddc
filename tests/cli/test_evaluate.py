"""`dropless eval` on a run it cannot write to (issue 53 row 12): the numbers print, a note says
they were not recorded, and the command succeeds."""

import errno
import types

from dropless.cli import _evaluate as evaluate

RESULT = {"data": "d", "step": 4, "batches": 1, "batch_size": 2, "seq_len": 8, "tokens": 16,
          "bytes": None, "ce": 1.0, "perplexity": 2.718, "bits_per_byte": None,
          "loss": 1.1}  # fmt: skip


def test_a_read_only_run_gets_its_numbers_and_a_note(tmp_path, monkeypatch, capsys):
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setattr(evaluate, "load_run", lambda *a: types.SimpleNamespace(metrics_path=path))
    monkeypatch.setattr(evaluate, "evaluate_run", lambda *a, **k: RESULT)

    def read_only(path, record):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(evaluate, "append_metrics", read_only)
    args = evaluate.EvalCommand(run_dir="r")
    assert evaluate.run(args) == 0
    out, err = capsys.readouterr()
    assert "perplexity" in out
    assert err.strip() == (
        f"dropless eval: note: not recorded: cannot write {path}: the file system is read-only"
    )
