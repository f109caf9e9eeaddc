"""The training loop end to end on the tiny preset: learning, balancing, exact resume, NaN stop,
bad input.

Every run uses batch 8 x 32 tokens, so one compiled train step and one compiled eval step serve
the module (tests/conftest.py drops compiled programs between modules).
"""

import dataclasses
import functools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import warnings

import equinox as eqx
import jax
import numpy as np
import pytest

from dropless.backends import jnp_backend
from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import (
    Callback,
    Checkpointer,
    CheckpointError,
    TrainingDiverged,
    TrainingPreempted,
    config_dict,
    init_state,
    read_jsonl,
    train,
)
from dropless.train.loop import _data_source as data_source
from dropless.train.loop import _setup as setup
from dropless.train.store import RunDirectoryLocked
from dropless.train.store._lock import RunLock

# Two layers (a dense and an MoE layer) and the MTP block: what the loop does is the same with
# four, and their steps take half the time.
TINY = get_preset("tiny", num_hidden_layers=2)


@pytest.fixture(scope="module")
def config(train_config):
    """The tests' short run on the synthetic corpus, 40 steps long: the tests below rely on its
    vocabulary (uniform loss log 512)."""
    return functools.partial(train_config, data="synthetic", steps=40, warmup_steps=5)


class Interrupt(Exception):
    pass


class InterruptAt(Callback):
    """A crash: raises after step `step` is logged (before that step's checkpoint), or with
    `at_eval`, as that step's evaluation is reported (after its checkpoint)."""

    def __init__(self, step: int, *, at_eval: bool = False):
        self.step, self.at_eval = step, at_eval

    def on_step(self, record: dict) -> None:
        if not self.at_eval and record["step"] == self.step:
            raise Interrupt

    def on_eval(self, record: dict) -> None:
        if self.at_eval and record["step"] == self.step:
            raise Interrupt


def _without_timing(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("step_time", "tokens_per_s", "mfu")}


@pytest.mark.slow
def test_loss_decreases_on_the_synthetic_corpus(tmp_path, config):
    results = train(TINY, config(), backend="jnp", out_dir=str(tmp_path))
    ce = [r["ce"] for r in results.records]
    assert len(ce) == 40
    uniform = math.log(TINY.vocab_size)
    assert ce[0] > uniform - 0.5
    assert np.mean(ce[-5:]) < ce[0] - 1.0
    assert results.final_eval["step"] == 40
    assert results.final_eval["ce"] < uniform - 1.0


@pytest.mark.slow
def test_bias_balancing_lowers_max_vio(tmp_path, config):
    runs = {}
    for rate in (0.0, 1e-2):
        runs[rate] = train(
            TINY,
            config(bias_update_rate=rate, seq_balance_loss_coef=0.0),
            backend="jnp",
            out_dir=str(tmp_path / str(rate)),
        )
    late = {rate: np.mean([r["max_vio"] for r in run.records[-20:]]) for rate, run in runs.items()}
    assert late[1e-2] < 0.8 * late[0.0]

    def overall(load):  # MaxVio of the load summed over the run, mean over layers
        return np.mean(load.max(-1) / load.mean(-1) - 1)

    assert overall(runs[1e-2].expert_load) < 0.8 * overall(runs[0.0].expert_load)


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, config):
    settings = config(steps=12, checkpoint_every=4, eval_every=6)
    full = train(TINY, settings, backend="jnp", out_dir=str(tmp_path / "full"))
    assert Checkpointer(str(tmp_path / "full" / "checkpoints")).steps() == [4, 8, 12]

    crashed = str(tmp_path / "crashed")
    with pytest.raises(Interrupt):
        train(TINY, settings, backend="jnp", out_dir=crashed, callbacks=[InterruptAt(10)])
    resumed = train(
        TINY, dataclasses.replace(settings, resume=True), backend="jnp", out_dir=crashed
    )
    assert [r["step"] for r in resumed.records] == [9, 10, 11, 12]
    for got, want in zip(resumed.records, full.records[8:], strict=True):
        assert _without_timing(got) == _without_timing(want)  # exact, not approximate
    for x, y in zip(_leaves(full.state), _leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(full.expert_load, resumed.expert_load)
    # the log of the resumed run reads like the uninterrupted one, each step once
    logged = [_without_timing(r) for r in read_jsonl(resumed.files["metrics"])]
    expected = [_without_timing(r) for r in read_jsonl(full.files["metrics"])]
    assert logged == expected

    # resumed again at its last step, layers unrolled (no array changes): nothing runs, nothing
    # is logged twice, and the summary still holds the final records
    unrolled = TINY.replace(unroll_layers=True)
    again = train(
        unrolled, dataclasses.replace(settings, resume=True), backend="jnp", out_dir=crashed
    )
    assert again.records == [] and again.eval_records == []
    assert again.final_eval["step"] == 12 and again.final_eval in again.earlier_records
    assert [_without_timing(r) for r in read_jsonl(again.files["metrics"])] == expected
    with open(again.files["summary"]) as f:
        summary = json.load(f)
    assert summary["final_train"]["step"] == summary["final_eval"]["step"] == 12


class SigtermAt(Callback):
    """A preemption notice: SIGTERM to this process as step `step` is logged."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, record: dict) -> None:
        if record["step"] == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_sigterm_saves_the_step_and_stops_and_resume_continues_exactly(tmp_path, config):
    """No periodic checkpoints: the one SIGTERM's stop saves is all there is to resume from.
    The handler is this run's only: the process's own stays in place before and after."""
    settings = config(steps=6, eval_every=0)
    full = train(TINY, settings, backend="jnp", out_dir=str(tmp_path / "full"))
    stopped = str(tmp_path / "stopped")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingPreempted, match="after step 3") as info:
        train(TINY, settings, backend="jnp", out_dir=stopped, callbacks=[SigtermAt(3)])
    assert info.value.step == 3
    assert signal.getsignal(signal.SIGTERM) is before
    assert Checkpointer(os.path.join(stopped, "checkpoints")).steps() == [3]
    assert [r["step"] for r in read_jsonl(os.path.join(stopped, "metrics.jsonl"))] == [1, 2, 3]
    resumed = train(
        TINY, dataclasses.replace(settings, resume=True), backend="jnp", out_dir=stopped
    )
    assert [r["step"] for r in resumed.records] == [4, 5, 6]
    for got, want in zip(resumed.records, full.records[3:], strict=True):
        assert _without_timing(got) == _without_timing(want)


class SignalAt(Callback):
    """`signum` to this process at a moment: "start" (before the first step compiles) or
    "final_save" (as the last step's checkpoint is saved)."""

    def __init__(self, signum: int, moment: str, steps: int):
        self.signum, self.moment, self.steps = signum, moment, steps

    def on_start(self, info: dict) -> None:
        if self.moment == "start":
            os.kill(os.getpid(), self.signum)

    def on_checkpoint(self, step: int, path: str) -> None:
        if self.moment == "final_save" and step == self.steps:
            os.kill(os.getpid(), self.signum)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "moment", "saved"),
    [
        (signal.SIGTERM, "final_save", 3),  # row 2: after the last step is logged
        (signal.SIGINT, "start", 1),  # row 3: Ctrl-C during the first compile
        (signal.SIGINT, "final_save", 3),
    ],
)
def test_a_signal_at_any_moment_of_the_steps_ends_with_the_step_saved(
    tmp_path, config, signum, moment, saved
):
    """Issue 53 rows 2 and 3: the process's own handler (here one that records) never sees
    the signal, the run stops with its newest step saved, and says which signal it was."""
    got = []

    def recorder(signum, frame):
        got.append(signum)

    previous = signal.signal(signum, recorder)
    try:
        with pytest.raises(TrainingPreempted) as info:
            train(TINY, config(steps=3), backend="jnp", out_dir=str(tmp_path),
                  callbacks=[SignalAt(signum, moment, 3)])  # fmt: skip
        assert signal.getsignal(signum) is recorder  # put back after the steps
    finally:
        signal.signal(signum, previous)
    assert got == []
    assert info.value.step == saved and signal.Signals(signum).name in str(info.value)
    assert Checkpointer(str(tmp_path / "checkpoints")).steps()[-1] == saved


@pytest.mark.slow
def test_a_model_without_moe_layers_checkpoints_and_resumes(tmp_path, config):
    """One dense layer, no MTP block: no MoE statistics (a 0 x experts expert load), a run
    like any other, with plots."""
    dense = TINY.replace(num_hidden_layers=1, num_nextn_predict_layers=0)
    settings = config(steps=4, checkpoint_every=2, plots=True)
    full = train(dense, settings, backend="jnp", out_dir=str(tmp_path / "full"))
    assert full.expert_load.shape == (0, dense.n_routed_experts)
    assert Checkpointer(str(tmp_path / "full" / "checkpoints")).steps() == [2, 4]

    cut = str(tmp_path / "cut")
    with pytest.raises(Interrupt):
        train(dense, settings, backend="jnp", out_dir=cut, callbacks=[InterruptAt(3)])
    resumed = train(dense, dataclasses.replace(settings, resume=True), backend="jnp", out_dir=cut)
    assert [r["step"] for r in resumed.records] == [3, 4]
    for got, want in zip(resumed.records, full.records[2:], strict=True):
        assert _without_timing(got) == _without_timing(want)
    assert os.path.exists(resumed.files["loss_plot"])


@pytest.mark.slow
def test_an_evaluation_cut_short_runs_again_on_resume(tmp_path, config):
    out = str(tmp_path)
    settings = config(steps=8, checkpoint_every=4, eval_every=4)
    for interrupted_at in (4, 8):  # mid-run, then the final evaluation
        with pytest.raises(Interrupt):
            train(
                TINY,
                settings,
                backend="jnp",
                out_dir=out,
                callbacks=[InterruptAt(interrupted_at, at_eval=True)],
            )
        settings = dataclasses.replace(settings, resume=True)
        assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() == interrupted_at
    results = train(TINY, settings, backend="jnp", out_dir=out)
    evals = [r["step"] for r in read_jsonl(results.files["metrics"]) if r["split"] == "eval"]
    assert evals == [4, 8] and results.final_eval["step"] == 8


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


@pytest.mark.slow
def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, config):
    out = str(tmp_path)
    settings = config(steps=8, checkpoint_every=2)
    with pytest.raises(Interrupt):
        train(TINY, settings, backend="jnp", out_dir=out, callbacks=[InterruptAt(5)])
    # resumed with an absurd learning rate, the next update overflows
    bad = dataclasses.replace(settings, resume=True, lr=1e30, warmup_steps=0)
    with pytest.raises(TrainingDiverged, match="last good checkpoint is step 4") as err:
        train(TINY, bad, backend="jnp", out_dir=out)
    assert "diverged at step 5" in str(err.value)
    checkpoints = Checkpointer(str(tmp_path / "checkpoints"))
    assert checkpoints.steps() == [2, 4]
    state, _ = checkpoints.restore(init_state_like(config))
    assert all(np.isfinite(x).all() for x in _leaves(state))
    assert all(math.isfinite(r["loss"]) for r in read_jsonl(str(tmp_path / "metrics.jsonl")))


def init_state_like(config):
    return init_state(DeepSeekV3(TINY, key=jax.random.key(0)), config())


@pytest.mark.slow
def test_token_file_training_and_out_of_vocabulary_ids(tmp_path, config):
    good = tmp_path / "good.bin"
    np.random.default_rng(0).integers(0, 512, 5000).astype(np.uint16).tofile(good)
    results = train(
        TINY, config(steps=3, data=str(good)), backend="jnp", out_dir=str(tmp_path / "ok")
    )
    assert len(results.records) == 3 and results.final_eval is not None

    # a held-out tail shorter than one window fails before the first step, not at the first
    # evaluation (5000 tokens, 0.5% held out: 25 < seq_len + 1)
    short = tmp_path / "short"
    with pytest.raises(ValueError, match="fewer than one window"):
        train(TINY, config(data=str(good), eval_fraction=0.005), backend="jnp", out_dir=str(short))
    assert not short.exists()

    bad = tmp_path / "bad.bin"
    tokens = np.random.default_rng(0).integers(0, 512, 5000).astype(np.uint16)
    tokens[::50] = 600  # ids past the tiny vocabulary (512)
    tokens.tofile(bad)
    # found when the data is opened, naming the file and the offset (issue 53 row 7)
    with pytest.raises(ValueError, match=r"bad\.bin: token id 600 at offset 0 .*the model's"):
        train(TINY, config(data=str(bad)), backend="jnp", out_dir=str(tmp_path / "bad"))


def test_a_warmup_longer_than_the_run_warns(config):
    with pytest.warns(UserWarning, match=r"warmup_steps \(20\) > steps \(5\): the learning"):
        setup.validate(TINY, config(steps=5, warmup_steps=20))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        setup.validate(TINY, config(steps=20, warmup_steps=20))  # reaches lr at the last step


def test_bf16_weights_need_float32_parameters(config):
    bf16 = TINY.replace(param_dtype="bfloat16")
    with pytest.raises(ValueError, match="param_dtype must be 'float32'"):
        setup.validate(bf16, config(weight_dtype="bfloat16"))
    setup.validate(bf16, config())
    setup.validate(TINY, config(weight_dtype="bfloat16"))


def test_bad_settings_are_clear_errors(tmp_path, config):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        train(TINY, config(seq_len=1024), backend="jnp", out_dir=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="TrainConfig.batch_size"):
        config(batch_size=0)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        train(TINY, config(), backend="nope", out_dir=str(tmp_path / "b"))
    with pytest.raises(CheckpointError, match="does not exist"):
        train(TINY, config(resume=True), backend="jnp", out_dir=str(tmp_path / "c"))


def test_checkpoints_of_another_run_are_not_overwritten_or_misused(tmp_path, config):
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    meta = {"config": config_dict(TINY, config(), "jnp")}
    checkpointer.save(3, init_state_like(config), meta)
    checkpointer.close()
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        train(TINY, config(), backend="jnp", out_dir=str(tmp_path))
    other = TINY.replace(n_routed_experts=8)
    with pytest.raises(CheckpointError, match="n_routed_experts: 16 -> 8"):
        train(other, config(resume=True), backend="jnp", out_dir=str(tmp_path))


def test_a_backend_value_runs_as_its_name_does(tmp_path, config):
    """`train` takes a `Backend` value as well as a name (resolved once, at this edge)."""
    settings = config(steps=2, warmup_steps=1)
    named = train(TINY, settings, backend="jnp", out_dir=str(tmp_path / "named"))
    value = train(TINY, settings, backend=jnp_backend(), out_dir=str(tmp_path / "v"))
    np.testing.assert_array_equal(value.losses, named.losses)
    assert "backend: custom" in (tmp_path / "v" / "config.yaml").read_text()


def test_train_takes_the_data_opened_and_opens_none_itself(tmp_path, config, monkeypatch):
    """`train(..., data=...)` runs on the source given, opening nothing; without it,
    `train_config.data` is opened once; the two runs are the same."""
    settings = config(steps=2, warmup_steps=1)
    source = data_source.open_data(settings, TINY.vocab_size)
    real, opened = data_source.SyntheticCorpus, []

    def counted(*args, **kwargs):
        opened.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(data_source, "SyntheticCorpus", counted)
    given = train(TINY, settings, backend="jnp", out_dir=str(tmp_path / "given"), data=source)
    assert opened == []
    fresh = train(TINY, settings, backend="jnp", out_dir=str(tmp_path / "fresh"))
    assert len(opened) == 1
    np.testing.assert_array_equal(given.losses, fresh.losses)


@pytest.mark.slow
def test_a_second_run_on_a_locked_directory_is_refused_naming_the_holder(tmp_path, config):
    """Another process holds the run directory: `train` refuses it before writing anything,
    naming that process; once the holder dies (SIGKILL), the OS has released the lock."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from dropless.train.store._lock import RunLock; "
            f"RunLock({str(tmp_path)!r}); print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        pattern = f"in use by another run \\(pid {holder.pid} on host {socket.gethostname()}\\)"
        with pytest.raises(RunDirectoryLocked, match=pattern):
            train(TINY, config(steps=1, warmup_steps=0), backend="jnp", out_dir=str(tmp_path))
        assert not (tmp_path / "metrics.jsonl").exists()
        assert not (tmp_path / "checkpoints").exists()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    RunLock(str(tmp_path)).release()  # free again


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_resume_passes_over_broken_checkpoints_to_the_newest_intact_one(tmp_path, config):
    out = str(tmp_path)
    settings = config(steps=6, checkpoint_every=2, warmup_steps=0)
    full = train(TINY, settings, backend="jnp", out_dir=out)
    ckpt = tmp_path / "checkpoints"
    for path in (ckpt / "6").iterdir():  # an empty folder
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    data = max((p for p in (ckpt / "4").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a corrupt byte
    data.write_bytes(bytes(raw))
    resumed_settings = dataclasses.replace(settings, resume=True)
    with pytest.warns(UserWarning) as caught:
        resumed = train(TINY, resumed_settings, backend="jnp", out_dir=out)
    notes = [str(w.message) for w in caught]
    assert any(re.search(r"checkpoints/6 is empty", n) for n in notes)
    assert any(re.search(r"checkpoints/4 is corrupt", n) for n in notes)
    assert [r["step"] for r in resumed.records] == [3, 4, 5, 6]
    assert resumed.losses == full.losses[2:]
    assert sorted(os.listdir(tmp_path / "checkpoints-set-aside")) == ["4", "6"]
    logged = [r["step"] for r in read_jsonl(resumed.files["metrics"]) if r["split"] == "train"]
    assert logged == [1, 2, 3, 4, 5, 6]

    # --resume-step chooses: back to step 4, the newer one set aside again
    again = train(
        TINY, dataclasses.replace(resumed_settings, resume_step=4), backend="jnp", out_dir=out
    )
    assert [r["step"] for r in again.records] == [5, 6]
    assert again.losses == full.losses[4:]
    with pytest.raises(CheckpointError, match="no checkpoint for step 5"):
        bad_step = dataclasses.replace(resumed_settings, resume_step=5)
        train(TINY, bad_step, backend="jnp", out_dir=out)


@pytest.mark.slow
def test_an_absurd_update_is_never_saved_and_the_named_checkpoint_resumes(tmp_path, config):
    """At lr 1e6 the updates stay finite for a while (AdamW normalises the gradient) but
    replace the model; the step that does so is stopped before its checkpoint, and the
    checkpoint the message names resumes at a sane learning rate without diverging."""
    out = str(tmp_path)
    settings = config(steps=6, checkpoint_every=1, lr=1e6, warmup_steps=2)
    with pytest.raises(TrainingDiverged) as err:
        train(TINY, settings, backend="jnp", out_dir=out)
    message = str(err.value)
    assert "the learning rate (lr=1e+06" in message and "likely too high" in message
    named = int(re.search(r"last good checkpoint is step (\d+)", message).group(1))
    failed = int(re.search(r"diverged at step (\d+)", message).group(1))
    assert Checkpointer(str(tmp_path / "checkpoints")).steps()[-1] == named == failed - 1
    logged = [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))]
    assert max(logged) == named  # the failed step is not logged either
    sane = dataclasses.replace(settings, resume=True, lr=3e-3)
    with pytest.warns(UserWarning, match="lr: 1000000.0 -> 0.003"):
        resumed = train(TINY, sane, backend="jnp", out_dir=out)
    assert resumed.records[0]["step"] == named + 1
    assert all(math.isfinite(r["loss"]) for r in resumed.records)
    assert all(r["update_norm"] < r["param_norm"] for r in resumed.records)
