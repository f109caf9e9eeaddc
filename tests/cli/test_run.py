"""What `dropless train` says when it is interrupted: only what is true (issue 53 row 3); the
data it opens once."""

import errno
import os

import pytest

from dropless.cli import parse
from dropless.cli._run import disk_line, run_train, what_is_saved
from dropless.train.loop import _data_source as data_source
from dropless.train.store import _lock as run_lock


def test_no_resume_advice_without_a_checkpoint(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    said = what_is_saved(str(tmp_path))
    assert "nothing to resume" in said and "--resume" not in said
    assert "nothing to resume" in what_is_saved(str(tmp_path / "never-created"))


def test_the_newest_checkpoint_is_named(tmp_path):
    for name in ("3", "12", "7.orbax-checkpoint-tmp-1"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    said = what_is_saved(str(tmp_path))
    assert "step 12" in said and f"--out-dir {tmp_path} --resume" in said


def test_a_read_only_out_dir_is_one_line(tmp_path, monkeypatch, capsys):
    """Row 12: the run directory's lock cannot be written: one line naming it, exit 1, before
    anything is compiled."""
    real = os.open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(run_lock.os, "open", read_only)
    out = tmp_path / "run"
    command = parse(["train", "--data", "synthetic", "--out-dir", str(out), "--steps", "1",
                     "--no-progress", "--backend", "jnp"])  # fmt: skip
    assert run_train(command) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dropless: error: cannot write {out}/.lock: the file system is read-only"]


def test_the_line_of_a_full_disk_names_the_free_space(tmp_path):
    line = disk_line(OSError(errno.ENOSPC, "No space left on device"), str(tmp_path))
    assert line.startswith(f"no space left on the device of {tmp_path} (") and "free" in line


@pytest.mark.slow
def test_the_data_is_opened_once(tmp_path, monkeypatch, capsys):
    """The command opens the data (to fit the vocabulary to the tokenizer's) and `train` takes
    it opened: one opening per run."""
    real, opened = data_source.SyntheticCorpus, []

    def counted(*args, **kwargs):
        opened.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(data_source, "SyntheticCorpus", counted)
    command = parse(["train", "--data", "synthetic", "--out-dir", str(tmp_path / "run"),
                     "--steps", "1", "--warmup-steps", "0", "--batch-size", "2", "--seq-len",
                     "16", "--eval-batches", "1", "--no-plots", "--no-progress", "--no-sample",
                     "--no-compile-cache", "--backend", "jnp"])  # fmt: skip
    assert run_train(command) == 0
    assert len(opened) == 1
    assert "Done in" in capsys.readouterr().out
