"""The pieces of multi-process runs that one process can check: which rows a process reads,
a dataset's rows, the environment a job starts from, the launcher's arguments and errors.
(tests/train/loop/test_multiprocess.py runs real processes.)"""

import numpy as np
import pytest

from dropless import cli, sharding
from dropless.cli._launch import child_args
from dropless.data._datasets import SyntheticCorpus, TokenFile
from dropless.train.loop import _distributed as distributed


@pytest.mark.mesh8
def test_one_process_reads_every_row():
    mesh = sharding.mesh_from_spec("data=2,expert=4")
    assert distributed.local_rows(mesh, 16) == slice(0, 16)
    assert distributed.is_main()


def test_rows_of_a_batch_are_those_of_the_whole_batch(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    kwargs = dict(seed=3, batch_size=8, seq_len=16, split="train")
    for dataset in (TokenFile(str(path)), SyntheticCorpus(64)):
        whole = dataset.batch(5, **kwargs)
        part = dataset.batch_rows(5, slice(4, 8), **kwargs)
        np.testing.assert_array_equal(part.tokens, whole.tokens[4:8])
        np.testing.assert_array_equal(part.language, whole.language[4:8])


def test_no_job_in_the_environment_means_one_process(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # a one-task srun step is no job
    assert distributed.initialize_from_env() is False


def test_a_coordinator_without_a_process_count_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers"):
        distributed.initialize_from_env()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    with pytest.raises(ValueError, match=r"JAX_PROCESS_ID \(2\) must be in \[0, "):
        distributed.initialize_from_env()


def test_children_get_the_same_arguments_and_one_output_directory():
    args = ["--local-processes", "2", "--mesh", "data=2", "--local-processes=3", "--steps", "4"]
    assert child_args(args, "/runs/a") == [
        "--mesh",
        "data=2",
        "--steps",
        "4",
        "--out-dir",
        "/runs/a",
    ]


def test_bad_process_count_is_a_clear_error(tmp_path, capsys):
    code = cli.main(["train", "--local-processes", "0", "--out-dir", str(tmp_path / "run")])
    assert code == 2
    assert "dropless: error: --local-processes must be >= 1, got 0" in capsys.readouterr().err
