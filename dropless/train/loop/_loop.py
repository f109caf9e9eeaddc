"""`train`: the training loop, drivable from Python.

    from dropless.models.deepseek_v3 import get_preset
    from dropless.train import TrainConfig, train

    results = train(get_preset("tiny"), TrainConfig(steps=200), out_dir="runs/tiny")

It writes into `out_dir`: `config.yaml` (what ran: rerun with `dropless train --config`),
`metrics.jsonl` (a record per step and per evaluation), `checkpoints/<step>/` (orbax),
`loss.png` and `expert_load.png`, `summary.json`. It never prints: progress goes to callbacks
(`dropless.train.loop.ProgressBar`, or your own `Callback`). Before the first step:
`dropless.train.loop._setup`; after the last: `dropless.train.loop._finish`.
"""

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dropless import sharding
from dropless.backends import AutoBackend, Backend
from dropless.data._datasets import AbstractDataset
from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from dropless.train._config import TrainConfig
from dropless.train.loop import _dead_experts as dead_experts
from dropless.train.loop import _distributed as distributed
from dropless.train.loop import _offload as offload
from dropless.train.loop import _setup as setup
from dropless.train.loop import _throughput as throughput
from dropless.train.loop._callbacks import Callback
from dropless.train.loop._data_source import DataSource
from dropless.train.loop._dead_experts import DeadExperts
from dropless.train.loop._finish import TrainResults, finish
from dropless.train.loop._guard import TrainingDiverged, check_step
from dropless.train.loop._preempt import StopOnSigterm, TrainingPreempted
from dropless.train.loop._setup import Run
from dropless.train.loop._throughput import Throughput
from dropless.train.step._sharded import sharded_eval_step, sharded_train_step
from dropless.train.step._step import eval_step, hparams, train_step

__all__ = ["TrainingDiverged", "TrainingPreempted", "evaluate", "run_steps", "train"]

_SCALARS = (
    "loss",
    "ce",
    "mtp",
    "balance_loss",
    "seq_balance_loss",
    "global_balance_loss",
    "z_loss",
    "max_vio",
    "dropped",
    "router_entropy",
    "unused_experts",
    "active_experts",
    "grad_norm",
    "update_norm",
    "param_norm",
    "lr",
)
_EVAL_SCALARS = ("loss", "ce", "mtp", "balance_loss", "seq_balance_loss", "z_loss", "max_vio")


def evaluate(
    model: DeepSeekV3,
    dataset: AbstractDataset,
    train_config: TrainConfig,
    *,
    mesh: Mesh | None = None,
) -> dict:
    """Mean loss terms and MaxVio over `train_config.eval_batches` held-out batches (the same
    batches every time), each in `train_config.micro_batches` passes. With `mesh`, `model`
    must be placed on it (as `train` does) and each batch is split over its batch axes."""
    weights = hparams(train_config)
    micro = train_config.micro_batches
    sums = dict.fromkeys(_EVAL_SCALARS, 0.0)
    for i in range(train_config.eval_batches):
        tokens = distributed.read_batch(dataset, i, train_config, "eval", mesh)
        setup.check_batch(tokens, model.config)
        if mesh is None:
            out = eval_step(model, jnp.asarray(tokens), weights, micro)
        else:
            out = sharded_eval_step(mesh, model, sharding.shard_batch(tokens, mesh), weights, micro)
        out = jax.device_get(out)
        for name in _EVAL_SCALARS:
            sums[name] += float(out[name])
    return {name: value / train_config.eval_batches for name, value in sums.items()}


def _host_metrics(metrics: dict) -> dict:
    host = jax.device_get(metrics)
    record = {name: float(host[name]) for name in _SCALARS}
    record["max_vio_layers"] = [float(v) for v in host["max_vio_layers"]]
    return record


def _run_eval(run: Run, step: int, eval_records: list[dict]) -> None:
    results = evaluate(run.state.model, run.eval_data, run.train_config, mesh=run.mesh)
    record = {"split": "eval", "step": step, **results}
    eval_records.append(record)
    run.writer.write(record)
    for callback in run.callbacks:
        callback.on_eval(record)


def _evaluated(run: Run, step: int, eval_records: list[dict]) -> bool:
    return any(r["step"] == step and r["split"] == "eval" for r in run.writer.kept + eval_records)


def _save(run: Run, step: int, dead: DeadExperts) -> None:
    meta = {**run.meta, "step": step, dead_experts.META_KEY: dead.saved()}
    run.checkpointer.save(step, run.state, meta)
    for callback in run.callbacks:
        callback.on_checkpoint(step, os.path.join(run.files["checkpoints"], str(step)))


def _train_step(run: Run, step: int, meter: Throughput, dead: DeadExperts) -> dict:
    """Runs step `step` (0-based) on `run.state`; returns its metrics record (tokens/s and MFU
    over the open interval of `meter`, the dead experts of `dead`'s window)."""
    config = run.train_config
    tokens = distributed.read_batch(run.train_data, step, config, "train", run.mesh)
    setup.check_batch(tokens, run.model_config)
    began = time.perf_counter()
    if config.offload_optimizer:
        run.state, metrics = offload.train_step(run.mesh, run.state, tokens, config.micro_batches)
    elif run.mesh is None:
        run.state, metrics = train_step(run.state, jnp.asarray(tokens), config.micro_batches)
    else:
        tokens = sharding.shard_batch(tokens, run.mesh)
        run.state, metrics = sharded_train_step(run.mesh, run.state, tokens, config.micro_batches)
    record = _host_metrics(metrics)  # waits for the step
    loads = jax.device_get(metrics["tokens_per_expert"])
    record["dead_experts"] = dead.update(step + 1, loads)
    elapsed = time.perf_counter() - began
    # before the step is logged or saved: the last checkpoint stays the last good one
    check_step(record, step + 1, config, run.model_config, run.checkpointer)
    tokens_per_s, mfu = meter.lap()
    return {
        "split": "train",
        "step": step + 1,
        **record,
        "step_time": elapsed,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
    }


def _after_step(
    run: Run, record: dict, eval_records: list[dict], meter: Throughput, dead: DeadExperts
) -> None:
    """Logs a step's record, then saves and evaluates when due."""
    config, done = run.train_config, record["step"]
    logged = done % config.log_every == 0 or done == config.steps
    if logged:
        run.writer.write(record)
    for callback in run.callbacks:
        callback.on_step(record)
    # saved before evaluating: an evaluation that fails loses no training
    if config.checkpoint_every and done % config.checkpoint_every == 0:
        _save(run, done, dead)
    if config.eval_every and done % config.eval_every == 0:
        _run_eval(run, done, eval_records)
    if logged:
        meter.mark()  # the next interval starts after this one's saving and evaluating


def _stop(run: Run, step: int, signal_name: str | None, dead: DeadExperts) -> None:
    """Saves `step` (unless it is saved), waits for the files, raises TrainingPreempted."""
    if run.checkpointer.latest_step() != step:
        _save(run, step, dead)
    run.checkpointer.wait()
    raise TrainingPreempted(step, signal_name or "SIGTERM")


def run_steps(run: Run, stop: StopOnSigterm | None = None) -> tuple[list[dict], list[dict]]:
    """Trains from `run.state` to `TrainConfig.steps`, then saves and evaluates the final
    state (unless a resumed run has both already); closes the run's files. Returns this call's
    training and evaluation records. On SIGTERM or SIGINT, from the first step's compile to the
    final save, it saves the step it finishes and raises `TrainingPreempted`
    (`dropless.train.loop._preempt`); `stop`: the entered StopOnSigterm of a caller that took the
    signals earlier (`train`, for its setup), else one of its own."""
    config, start = run.train_config, int(run.state.step)
    records: list[dict] = []
    eval_records: list[dict] = []
    try:
        with contextlib.nullcontext(stop) if stop is not None else StopOnSigterm() as stop:
            # a checkpoint saved before its evaluation, which did not end: evaluated now
            every = config.eval_every
            if start and every and start % every == 0 and not _evaluated(run, start, eval_records):
                _run_eval(run, start, eval_records)
            devices = 1 if run.mesh is None else run.mesh.size
            meter = throughput.meter(run.model_config, config, devices)
            dead = DeadExperts(config.dead_expert_steps)
            if start:  # the resumed checkpoint's window
                dead.restore(run.checkpointer.read_meta(start).get(dead_experts.META_KEY))
            for step in range(start, config.steps):
                records.append(_train_step(run, step, meter, dead))
                if step == start:
                    meter.mark()  # the first step compiles: an interval of its own
                _after_step(run, records[-1], eval_records, meter, dead)
                if step + 1 < config.steps and stop.requested(step + 1):
                    _stop(run, step + 1, stop.signal_name, dead)
            if run.checkpointer.latest_step() != config.steps:
                _save(run, config.steps, dead)
            if stop.requested(config.steps):  # during the last step or its save
                _stop(run, config.steps, stop.signal_name, dead)
            if not _evaluated(run, config.steps, eval_records):
                _run_eval(run, config.steps, eval_records)
            run.checkpointer.wait()
    finally:
        run.writer.close()
        run.checkpointer.close()
    return records, eval_records


def train(
    model_config: DeepSeekV3Config,
    train_config: TrainConfig,
    *,
    backend: str | Backend | AutoBackend = AutoBackend(),  # noqa: B008 (immutable)
    out_dir: str,
    callbacks: Sequence[Callback] = (),
    mesh: str | None = None,
    data: DataSource | None = None,
) -> TrainResults:
    """Trains a DeepSeek-V3 model of `model_config` and writes its results into `out_dir`.

    `backend`: `AutoBackend()` (the best this machine runs; config.yaml records "auto"), an MoE
    backend name (see `dropless.train.BACKENDS`), or a `Backend` value (config.yaml then
    records "custom"); resolved once, here.
    `data`: the data of `train_config.data`, already opened
    (`dropless.train.loop.open_data(train_config, model_config.vocab_size)`, as the
    `dropless` command does to fit the model's vocabulary to the tokenizer's); None opens it
    here. Either way it is opened once.
    `train_config.resume`: continue from the latest checkpoint in `out_dir/checkpoints` (the
    model configuration must match, except its compute dtype, remat, attention implementation
    and layer unrolling; the training settings may change); the batches, and on CPU the losses,
    are exactly those of an uninterrupted run.
    `mesh` (or `train_config.mesh`; this argument wins): train on a device mesh, e.g.
    "data=2,expert=4" (see `dropless.train.step._sharded`): parameters and optimiser state sharded,
    batches split, the MoE layers on the "ep" dispatcher when expert > 1; the steps equal the
    single-device ones. A mesh of one device is the single-device run.

    Raises ValueError for bad settings or data (token ids outside the vocabulary, sequences
    longer than the model supports), CheckpointError for a missing, corrupt or mismatched
    checkpoint, TrainingDiverged when the loss becomes NaN/inf or an update is absurdly
    large (`dropless.train.loop._guard`; the checkpoints saved before that stay), and
    TrainingPreempted when SIGTERM or SIGINT stops it (the step it finished is saved).
    """
    if mesh is not None:
        train_config = dataclasses.replace(train_config, mesh=mesh)
    # the signals are taken from setup on: one that arrives while the state is restored or
    # the first step compiles stops the run after that step, saved
    with StopOnSigterm() as stop:
        run = setup.start(
            model_config,
            train_config,
            backend=backend,
            out_dir=out_dir,
            callbacks=callbacks,
            data=data,
        )
        try:
            records, eval_records = run_steps(run, stop)
        except BaseException:
            if run.lock is not None:
                run.lock.release()
            raise
    try:
        return finish(run, records, eval_records)
    finally:
        if run.lock is not None:
            run.lock.release()
