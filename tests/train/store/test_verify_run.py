"""`verify_run` (`dropless verify RUN`): config, checkpoint digests, data identity."""

import numpy as np
import pytest
from test_run_dir import saved_run  # a run written without training

from dropless.cli import _verify as verify
from dropless.train.loop import verify_run

orbax_failed_restore = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.mark.slow  # restores every checkpoint twice
@orbax_failed_restore
def test_verify_lists_every_check_and_finds_each_fault(tmp_path, capsys):
    data, run = saved_run(tmp_path)
    checks = verify_run(run, data_hashes=True)
    assert [c.what for c in checks] == ["config", "checkpoint 2", "checkpoint 4", "data"]
    assert all(c.ok for c in checks), checks
    # a flipped byte in a checkpoint, and the data's train.bin changed in place
    array = max((run / "checkpoints" / "4" / "state").rglob("*"), key=lambda p: p.stat().st_size)
    raw = bytearray(array.read_bytes())
    raw[len(raw) // 2] ^= 1
    array.write_bytes(bytes(raw))
    tokens = np.fromfile(data / "train.bin", np.uint16)
    tokens[0] = (tokens[0] + 1) % 200
    tokens.tofile(data / "train.bin")
    args = verify.VerifyCommand(run_dir=str(run), data_hashes=True)
    assert verify.run(args) == 1
    failed = [line for line in capsys.readouterr().out.splitlines() if "  FAIL  " in line]
    assert [line.split()[:2] for line in failed] == [["checkpoint", "4"], ["data", "FAIL"]]
    assert "differ from the digest" in failed[0]
    assert "train.bin differs from the SHA-256" in failed[1]
