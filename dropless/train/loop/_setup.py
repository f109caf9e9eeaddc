"""What `train` does before its first step: check the settings, resolve the backend and the
mesh, build the datasets, the model and its state (restored when resuming), and open the output
files. Everything that can fail on bad settings or data fails here, before anything is written.
"""

import dataclasses
import json
import os
from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np
import yaml
from jax.sharding import Mesh

from dropless.backends import AutoBackend, Backend
from dropless.data._datasets import AbstractDataset, Batch
from dropless.models.deepseek_v3 import DeepSeekV3Config, check_tokens
from dropless.train._backend_names import get_backend, resolve_backend_name
from dropless.train._config import TrainConfig
from dropless.train.loop import _distributed as distributed
from dropless.train.loop import _offload as offload
from dropless.train.loop._callbacks import Callback, TensorBoard
from dropless.train.loop._checks import check_backend_fits_mesh, validate
from dropless.train.loop._data_source import DataSource, check_vocab, open_data
from dropless.train.loop._metrics import MetricsWriter
from dropless.train.loop._start_state import fresh_state, open_checkpoints
from dropless.train.step._sharded_state import resolve_mesh, shard_state, stages
from dropless.train.step._step import TrainState, moe_layer_names
from dropless.train.store._atomic import write_atomic
from dropless.train.store._checkpoint import Checkpointer
from dropless.train.store._layout import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    CUSTOM_BACKEND,
    METRICS_FILE,
    SUMMARY_FILE,
)
from dropless.train.store._lock import RunLock


@dataclasses.dataclass
class Run:
    """A started run: what the loop reads and updates (`state`) and what it writes to."""

    model_config: DeepSeekV3Config
    train_config: TrainConfig
    state: TrainState
    mesh: Mesh | None
    train_data: AbstractDataset
    eval_data: AbstractDataset
    out_dir: str
    files: dict[str, str]  # name -> path of what is written (metrics, config, checkpoints, ...)
    checkpointer: Checkpointer
    writer: MetricsWriter
    callbacks: list[Callback]
    meta: dict  # saved with every checkpoint
    info: dict  # what `Callback.on_start` receives
    layer_names: list[str]  # rows of `expert_load` / `max_vio_layers`
    lock: RunLock | None  # the run directory's (process 0's), released when `train` returns
    data: DataSource | None = None  # what `train_config.data` opened to (its tokenizer, record)


def make_datasets(
    train_config: TrainConfig, vocab_size: int
) -> tuple[AbstractDataset, AbstractDataset]:
    """(train, eval) datasets for `train_config.data` (see `dropless.train.loop._data_source`)."""
    source = open_data(train_config, vocab_size)
    return source.train, source.eval


def config_dict(
    model_config: DeepSeekV3Config,
    train_config: TrainConfig,
    backend: str,
    data: dict | None = None,
    stages: dict | None = None,
) -> dict:
    """The YAML/JSON form of a run's configuration (what `dropless train --config` reads).
    `resume`, `resume_step` and `allow_data_change` are left out (false, None, false):
    rerunning a config starts a fresh run. `data`: the record of the data read
    (`DataSource.record`: its identity, checked when the run continues); `stages`: the MoE
    strategy that runs at each stage (`sharded_state.stages`), written for the reader only."""
    out = {
        "backend": backend,
        "model": dataclasses.asdict(model_config),
        "train": dataclasses.asdict(
            dataclasses.replace(
                train_config, resume=False, resume_step=None, allow_data_change=False
            )
        ),
    }
    if data is not None:
        out["data"] = data
    if stages:
        out["stages"] = stages
    return out


def batch(dataset: AbstractDataset, step: int, train_config: TrainConfig, split: str) -> Batch:
    """The batch of `step` of `split` ("train" or "eval")."""
    return dataset.batch(
        step,
        seed=train_config.seed,
        batch_size=train_config.batch_size,
        seq_len=train_config.seq_len,
        split=split,
    )


def check_batch(tokens: np.ndarray, model_config: DeepSeekV3Config) -> None:
    """Raises ValueError for token ids outside the vocabulary."""
    # Inputs, then the one column of targets the inputs do not contain.
    check_tokens(tokens[:, :-1], model_config)
    check_tokens(tokens[:, -1:], model_config)


def _output_files(out_dir: str) -> dict[str, str]:
    try:
        os.makedirs(out_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(
            f"out_dir {out_dir} is a file, or lies under one: give a directory"
        ) from None
    return {
        "metrics": os.path.join(out_dir, METRICS_FILE),
        "config": os.path.join(out_dir, CONFIG_FILE),
        "summary": os.path.join(out_dir, SUMMARY_FILE),
        "checkpoints": os.path.join(out_dir, CHECKPOINT_DIR),
    }


def _check_data(
    datasets: Sequence[AbstractDataset], model_config: DeepSeekV3Config, train_config: TrainConfig
) -> None:
    # One batch of each split, so that data too short for a window fails before any step (the
    # held-out split is otherwise first read at the first evaluation).
    for split, dataset in zip(("train", "eval"), datasets, strict=True):
        check_batch(batch(dataset, 0, train_config, split).tokens, model_config)


def _with_tensorboard(
    callbacks: Sequence[Callback], train_config: TrainConfig, out_dir: str
) -> list[Callback]:
    callbacks = list(callbacks)
    if train_config.tensorboard:
        callbacks.append(TensorBoard(os.path.join(out_dir, "tensorboard")))
    return callbacks


def _info(
    state: TrainState, train_config: TrainConfig, out_dir: str, backend: str, mesh: Mesh | None
) -> dict:
    """What `Callback.on_start` receives."""
    return {
        "start_step": int(state.step),
        "steps": train_config.steps,
        "out_dir": out_dir,
        "backend": backend,
        "backend_resolved": resolve_backend_name(backend),
        "mesh": None if mesh is None else dict(mesh.shape),
        "n_params": sum(x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))),
    }


def start(
    model_config: DeepSeekV3Config,
    train_config: TrainConfig,
    *,
    backend: str | Backend | AutoBackend,
    out_dir: str,
    callbacks: Sequence[Callback],
    data: DataSource | None = None,
) -> Run:
    """Checks the settings, then builds (or restores) the state and opens the output files;
    calls every callback's `on_start`. `backend` is resolved here, once (`get_backend`);
    `data` (None: `train_config.data`) is opened here unless it comes opened.
    In a multi-process job (`distributed.initialize_from_env`) only process 0 writes files and
    runs the callbacks."""
    distributed.initialize_from_env()
    validate(model_config, train_config)
    moe_backend = get_backend(backend)  # one that cannot load fails before anything is written
    name = "auto" if isinstance(backend, AutoBackend) else backend
    name = name if isinstance(name, str) else CUSTOM_BACKEND
    mesh = resolve_mesh(train_config.mesh, model_config, train_config)
    check_backend_fits_mesh(name, moe_backend, mesh)
    if data is None:
        data = open_data(train_config, model_config.vocab_size)
    check_vocab(model_config, data)
    _check_data((data.train, data.eval), model_config, train_config)
    out_dir = os.path.abspath(out_dir)
    files = _output_files(out_dir)
    # held until `train` returns or the process ends; by process 0 for a multi-process job
    lock = RunLock(out_dir) if distributed.is_main() else None
    try:
        return _open(
            model_config,
            train_config,
            backend=moe_backend,
            name=name,
            mesh=mesh,
            data=data,
            files=files,
            lock=lock,
            callbacks=callbacks,
        )
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _open(
    model_config: DeepSeekV3Config,
    train_config: TrainConfig,
    *,
    backend: Backend,
    name: str,
    mesh: Mesh | None,
    data: DataSource,
    files: dict[str, str],
    lock: RunLock | None,
    callbacks: Sequence[Callback],
) -> Run:
    """The rest of `start`, once the run directory is locked: the state, config.yaml, the
    metrics file, the callbacks' `on_start`."""
    out_dir = os.path.dirname(files["metrics"])
    fresh = fresh_state(model_config, train_config, backend, mesh)
    state, checkpointer = open_checkpoints(files["checkpoints"], fresh, train_config, data.record)
    if mesh is not None:
        state = shard_state(state, mesh)  # the resumed config's numbers, replicated

    if train_config.offload_optimizer:
        state = offload.to_host(state)
    run_config = config_dict(model_config, train_config, name, data.record, stages(state.model))
    if distributed.is_main():
        write_atomic(files["config"], [yaml.safe_dump(run_config, sort_keys=False)])
    else:
        callbacks = []
    keep_until = int(state.step) if train_config.resume else None
    writer = distributed.metrics_writer(files["metrics"], keep_until=keep_until)
    info = _info(state, train_config, out_dir, name, mesh)
    callbacks = _with_tensorboard(callbacks, train_config, out_dir)
    for callback in callbacks:
        callback.on_start(info)
    return Run(
        model_config=model_config,
        train_config=train_config,
        state=state,
        mesh=mesh,
        train_data=data.train,
        eval_data=data.eval,
        out_dir=out_dir,
        files=files,
        checkpointer=checkpointer,
        writer=writer,
        callbacks=callbacks,
        meta={"config": json.loads(json.dumps(run_config))},
        info=info,
        layer_names=moe_layer_names(state.model),
        lock=lock,
        data=data,
    )
