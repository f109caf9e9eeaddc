"""Several JAX processes on one machine (`dropless train --local-processes 2`, gloo CPU
collectives): a SIGTERM stopping both at one saved step, the resumed run's losses those of the
one-process run, a checkpoint written by two processes resumed by one, and a killed process
ending the run with a clear message.

The children get 4 emulated CPU devices each (this process has 8): the mesh data=2,expert=4
spans both, so the expert all-to-all and the gradient reductions cross processes. Every
subprocess runs under a timeout. A two-layer tiny model (a dense and an MoE layer, no MTP block)
at batch 8 x 32 keeps compiles short.
"""

import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dropless.models.deepseek_v3 import get_preset
from dropless.train import read_jsonl, train

pytestmark = [pytest.mark.mesh8, pytest.mark.slow]

MESH = "data=2,expert=4"
# Six steps, checkpointed at 3 and 6: every step is one more of the same (a step across two
# processes takes about a second on a CPU), and the resumed run takes three of them.
STEPS = 6
CHECKPOINT_EVERY = 3
TIMEOUT_S = 540
# The same program on the same devices; only the order in which gloo and the in-process
# collectives add the 8 partial gradients differs, so the float32 sums differ in the last bits
# and the difference grows a little through the Adam steps: 1e-5 relative (measured: 1.5e-7).
RTOL = 1e-5
MODEL = get_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
FLAGS = [
    "--model.num-hidden-layers", "2",
    "--model.num-nextn-predict-layers", "0",
    "--steps", str(STEPS),
    "--batch-size", "8",
    "--seq-len", "32",
    "--warmup-steps", "1",
    "--eval-every", "0",
    "--eval-batches", "1",
    "--checkpoint-every", str(CHECKPOINT_EVERY),
    "--data", "synthetic",
    "--no-sample",
    "--no-plots",
    "--no-progress",
    "--no-compile-cache",
    "--mesh", MESH,
]  # fmt: skip


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
    return env


def _launch(out_dir, *extra, **kwargs) -> subprocess.Popen:
    command = [sys.executable, "-m", "dropless", "train", "--local-processes", "2"]
    return subprocess.Popen(
        [*command, *FLAGS, *extra, "--out-dir", str(out_dir)],
        env=_child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _finish(process: subprocess.Popen, timeout: float = TIMEOUT_S) -> tuple[int, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return process.returncode, out + err


@dataclasses.dataclass
class StoppedAndResumed:
    """The module's two-process run: SIGTERMed once training runs, then resumed by two
    processes to the end. What the stop left (the launcher's exit status and output, the steps
    logged, process 1's log, the saved checkpoints) is kept for the test that reads it."""

    out: pathlib.Path
    stop_code: int
    stop_output: str
    stop_logged: list[int]
    stop_process_1_log: str
    stop_checkpoints: list[str]


def _wait_for_a_step(process: subprocess.Popen, out, poll_s: float) -> None:
    """Waits until training runs: process 0 has written a step's record."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").stat().st_size:
        assert process.poll() is None, process.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory) -> StoppedAndResumed:
    """A preemption notice: SIGTERM to the launcher once training runs; then `--resume` with
    two processes to the end of the run."""
    out = tmp_path_factory.mktemp("two") / "run"
    process = _launch(out, start_new_session=True)
    try:
        _wait_for_a_step(process, out, poll_s=0.2)
        process.send_signal(signal.SIGTERM)
        code, output = _finish(process, timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    checkpoints = out / "checkpoints"
    stopped = StoppedAndResumed(
        out=out,
        stop_code=code,
        stop_output=output,
        stop_logged=[
            r["step"] for r in read_jsonl(str(out / "metrics.jsonl")) if r["split"] == "train"
        ],
        stop_process_1_log=(out / "process-1.log").read_text(),
        stop_checkpoints=sorted(os.listdir(checkpoints)) if checkpoints.is_dir() else [],
    )
    if code == 128 + signal.SIGTERM:  # else the SIGTERM test fails, naming what happened
        code, output = _finish(_launch(out, "--resume", start_new_session=True))
        assert code == 0, output[-4000:]
    return stopped


def test_two_processes_equal_one_and_resume_in_one(two_process_run, tmp_path, train_config):
    """The two-process run, stopped and resumed by two processes, has the losses of the
    uninterrupted one-process run; its step-3 checkpoint, resumed by one process, too."""
    run = two_process_run.out
    assert two_process_run.stop_code == 128 + signal.SIGTERM, two_process_run.stop_output[-4000:]
    # the run of FLAGS
    config = dict(steps=STEPS, checkpoint_every=CHECKPOINT_EVERY, data="synthetic", mesh=MESH)
    records = [r for r in read_jsonl(str(run / "metrics.jsonl")) if r["split"] == "train"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # the periodic checkpoints, and the one of the step the SIGTERM stopped at
    stop = two_process_run.stop_logged[-1]
    saved = sorted(int(name) for name in os.listdir(run / "checkpoints") if name.isdigit())
    assert saved == sorted({stop, CHECKPOINT_EVERY, STEPS})
    # process 0 alone wrote the run's files; process 1 logged to its own
    assert (run / "summary.json").exists()
    assert (run / "process-1.log").exists()

    single = train(MODEL, train_config(**config), out_dir=str(tmp_path / "one"))
    want = single.losses
    got = [r["loss"] for r in records]
    print("max relative loss difference:", np.max(np.abs(np.subtract(got, want)) / want))
    np.testing.assert_allclose(got, want, rtol=RTOL)
    for name in ("ce", "max_vio", "grad_norm"):
        np.testing.assert_allclose(
            [r[name] for r in records], [r[name] for r in single.records], rtol=RTOL, atol=1e-6
        )

    # The step-3 checkpoint of the two processes, resumed by this one process on 8 devices.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run, resumed_dir)
    for step in saved:
        if step > CHECKPOINT_EVERY:
            shutil.rmtree(resumed_dir / "checkpoints" / str(step))
    resumed = train(MODEL, train_config(**config, resume=True), out_dir=str(resumed_dir))
    assert [r["step"] for r in resumed.records] == list(range(CHECKPOINT_EVERY + 1, STEPS + 1))
    np.testing.assert_allclose(resumed.losses, want[CHECKPOINT_EVERY:], rtol=RTOL)
    np.testing.assert_allclose(resumed.expert_load, single.expert_load, rtol=RTOL)


def test_sigterm_to_the_launcher_stops_both_at_one_saved_step(two_process_run):
    """A preemption notice: SIGTERM to the launcher once training runs. Both processes stop
    after the same step and save it, and the launcher exits with 143; resuming the two
    processes from there gives the losses of the uninterrupted run
    (`test_two_processes_equal_one_and_resume_in_one`)."""
    stopped = two_process_run
    output = stopped.stop_output
    assert stopped.stop_code == 128 + signal.SIGTERM, output[-4000:]
    assert "stopped by SIGTERM; continue with" in output
    logged = stopped.stop_logged
    stop = logged[-1]
    assert 1 <= stop < STEPS and logged == list(range(1, stop + 1)), output[-4000:]
    assert f"stopped by SIGTERM after step {stop}" in stopped.stop_process_1_log
    assert str(stop) in stopped.stop_checkpoints


def test_killing_one_process_ends_the_other(tmp_path):
    out = tmp_path / "run"
    # one MoE layer, quicker to compile: what a step computes matters not to how a run ends
    one_layer = ["--model.num-hidden-layers", "1", "--model.first-k-dense-replace", "0"]
    process = _launch(out, "--steps", "100000", *one_layer, start_new_session=True)
    try:
        _wait_for_a_step(process, out, poll_s=0.5)
        pids = json.loads((out / "local-processes.json").read_text())["pids"]
        os.kill(pids[1], signal.SIGKILL)
        code, output = _finish(process, timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == 1
    assert "dropless: error: process 1 of 2 was killed by SIGKILL" in output
    assert "stopping the other processes" in output
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)
