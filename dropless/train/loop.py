"""`train`: the training loop, drivable from Python.

    from dropless.models.deepseek_v3 import get_preset
    from dropless.train import TrainConfig, train

    results = train(get_preset("tiny"), TrainConfig(steps=200), out_dir="runs/tiny")

It writes into `out_dir`: `config.yaml` (what ran: rerun with `dropless train --config`),
`metrics.jsonl` (a record per step and per evaluation), `checkpoints/<step>/` (orbax),
`loss.png` and `expert_load.png`, `summary.json`. It never prints: progress goes to callbacks
(`dropless.train.metrics.ProgressBar`, or your own `Callback`).
"""

import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.sharding import Mesh

from dropless import sharding
from dropless.backends import Backend, get_backend, resolve_backend_name
from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config, check_tokens
from dropless.models.deepseek_v3.config import DROPLESS_FIELDS
from dropless.train import metrics as metrics_lib
from dropless.train.checkpoint import Checkpointer, CheckpointError, open_for_resume
from dropless.train.config import TrainConfig
from dropless.train.data import AbstractDataset, SyntheticCorpus, token_file_splits
from dropless.train.sharded import (
    prepare_model,
    resolve_mesh,
    shard_state,
    sharded_eval_step,
    sharded_train_step,
)
from dropless.train.step import (
    TrainState,
    eval_step,
    hparams,
    init_state,
    moe_layer_names,
    train_step,
    with_config,
)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "checkpoints"
LOSS_PLOT = "loss.png"
LOAD_PLOT = "expert_load.png"

_SCALARS = (
    "loss",
    "ce",
    "mtp",
    "balance_loss",
    "seq_balance_loss",
    "z_loss",
    "max_vio",
    "dropped",
    "grad_norm",
    "update_norm",
    "lr",
)


# Model settings that a resumed run may change: they touch no array.
_FREE_ON_RESUME = tuple(f for f in DROPLESS_FIELDS if f != "param_dtype")


class TrainingDiverged(RuntimeError):
    """The loss (or gradient) became NaN or infinite; the run stopped before saving it."""


@dataclasses.dataclass
class TrainResults:
    """What `train` returns. `records`/`eval_records` cover this call's steps only (the JSONL
    file holds the whole run, a resumed one included); `earlier_records` are the file's records
    from before a resume."""

    state: TrainState
    records: list[dict]
    eval_records: list[dict]
    out_dir: str
    files: dict[str, str]  # name -> path of what was written (metrics, config, checkpoints, ...)
    layer_names: list[str]  # rows of `expert_load` / `max_vio_layers`
    earlier_records: list[dict] = dataclasses.field(default_factory=list)

    @property
    def model(self) -> DeepSeekV3:
        """The trained model."""
        return self.state.model

    @property
    def losses(self) -> list[float]:
        """Training loss of each step of this call."""
        return [r["loss"] for r in self.records]

    @property
    def final_eval(self) -> dict | None:
        """The last evaluation record (at the final step), this call's or, for a run resumed
        at its last step, the earlier one."""
        return _last(self.earlier_records + self.eval_records, "eval")

    @property
    def expert_load(self) -> np.ndarray:
        """Tokens routed to each expert of each MoE layer, summed over the run [layers experts]."""
        return np.asarray(self.state.expert_load)


def make_datasets(
    train_config: TrainConfig, vocab_size: int
) -> tuple[AbstractDataset, AbstractDataset]:
    """(train, eval) datasets for `train_config.data`: the synthetic corpus or a token file."""
    if train_config.data == "synthetic":
        corpus = SyntheticCorpus(
            vocab_size, n_languages=train_config.n_languages, corpus_seed=train_config.corpus_seed
        )
        return corpus, corpus
    return token_file_splits(
        train_config.data,
        train_config.data_dtype,
        eval_path=train_config.eval_data,
        eval_fraction=train_config.eval_fraction,
    )


def config_dict(model_config: DeepSeekV3Config, train_config: TrainConfig, backend: str) -> dict:
    """The YAML/JSON form of a run's configuration (what `dropless train --config` reads).
    `resume` is left out (written as false): rerunning a config starts a fresh run."""
    return {
        "backend": backend,
        "model": dataclasses.asdict(model_config),
        "train": dataclasses.asdict(dataclasses.replace(train_config, resume=False)),
    }


def _batch(dataset: AbstractDataset, step: int, train_config: TrainConfig, split: str):
    return dataset.batch(
        step,
        seed=train_config.seed,
        batch_size=train_config.batch_size,
        seq_len=train_config.seq_len,
        split=split,
    )


def _last(records: list[dict], split: str) -> dict | None:
    """The last record of `split` ("train" or "eval") in `records`, else None."""
    return next((r for r in reversed(records) if r["split"] == split), None)


def _check_batch(tokens: np.ndarray, model_config: DeepSeekV3Config) -> None:
    # Inputs, then the one column of targets the inputs do not contain.
    check_tokens(tokens[:, :-1], model_config)
    check_tokens(tokens[:, -1:], model_config)


def _validate(model_config: DeepSeekV3Config, train_config: TrainConfig) -> None:
    if train_config.seq_len > model_config.max_position_embeddings:
        raise ValueError(
            f"seq_len ({train_config.seq_len}) is longer than the model supports "
            f"(max_position_embeddings = {model_config.max_position_embeddings})"
        )
    depth = model_config.num_nextn_predict_layers
    if depth and train_config.seq_len <= depth:
        raise ValueError(
            f"seq_len ({train_config.seq_len}) must exceed the MTP depth "
            f"(num_nextn_predict_layers = {depth})"
        )
    if train_config.warmup_steps > train_config.steps:
        warnings.warn(
            f"TrainConfig.warmup_steps ({train_config.warmup_steps}) > steps "
            f"({train_config.steps}): the learning rate never reaches lr ({train_config.lr:g})",
            stacklevel=3,
        )
    platform = jax.devices()[0].platform
    if model_config.attention_impl == "cudnn" and platform != "gpu":
        raise ValueError(
            "DeepSeekV3Config.attention_impl = 'cudnn' needs an NVIDIA GPU (cuDNN's fused "
            f"attention); JAX runs on {platform} here: use 'xla'"
        )


def _check_backend_fits_mesh(backend: str, bundle: Backend, mesh) -> None:
    """An expert-parallel backend runs only inside a mesh: refuse it without one, before
    anything is written."""
    if bundle.dispatcher.supports_expert_parallel and mesh is None:
        raise ValueError(
            f"backend {backend!r} is expert-parallel and needs a device mesh: give "
            "TrainConfig.mesh (--mesh expert=N, N dividing the device count; on a CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N emulates N devices), or a "
            "single-device backend such as 'auto'"
        )


def _host_metrics(metrics: dict) -> dict:
    host = jax.device_get(metrics)
    record = {name: float(host[name]) for name in _SCALARS}
    record["max_vio_layers"] = [float(v) for v in host["max_vio_layers"]]
    return record


_WATCHED = ("loss", "grad_norm", "update_norm")  # any of them non-finite: the run diverged


def _finite(record: dict) -> bool:
    return all(math.isfinite(record[name]) for name in _WATCHED)


def _diverged(record: dict, step: int, checkpointer: Checkpointer) -> TrainingDiverged:
    last = checkpointer.latest_step()
    where = (
        f"the last good checkpoint is step {last} in {checkpointer.directory}"
        if last is not None
        else "no checkpoint was saved before it"
    )
    bad = ", ".join(f"{k}={record[k]}" for k in _WATCHED if not math.isfinite(record[k]))
    return TrainingDiverged(
        f"training diverged at step {step}: {bad} (learning rate {record['lr']:.3g}). Stopped "
        f"without saving; {where}. Lower the learning rate (or check the data) and resume."
    )


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
    sums: dict[str, float] = {}
    for i in range(train_config.eval_batches):
        batch = _batch(dataset, i, train_config, "eval")
        _check_batch(batch.tokens, model.config)
        if mesh is None:
            out = eval_step(model, jnp.asarray(batch.tokens), weights, micro)
        else:
            tokens = sharding.shard_batch(batch.tokens, mesh)
            out = sharded_eval_step(mesh, model, tokens, weights, micro)
        out = jax.device_get(out)
        for name in ("loss", "ce", "mtp", "balance_loss", "seq_balance_loss", "z_loss", "max_vio"):
            sums[name] = sums.get(name, 0.0) + float(out[name])
    return {name: value / train_config.eval_batches for name, value in sums.items()}


def _restore(checkpointer: Checkpointer, fresh: TrainState) -> TrainState:
    """The latest checkpoint, after checking it was written for the same architecture."""
    saved = checkpointer.read_meta().get("config", {}).get("model") or {}
    current = json.loads(json.dumps(dataclasses.asdict(fresh.model.config)))
    changed = [
        k for k in current if k not in _FREE_ON_RESUME and k in saved and saved[k] != current[k]
    ]
    if changed:
        diffs = ", ".join(f"{k}: {saved[k]!r} -> {current[k]!r}" for k in changed)
        raise CheckpointError(
            f"cannot resume from {checkpointer.directory}: it was written for another model "
            f"configuration ({diffs})"
        )
    state, _ = checkpointer.restore(fresh)
    return state


def _open_checkpoints(
    directory: str, fresh: TrainState, train_config: TrainConfig
) -> tuple[TrainState, Checkpointer]:
    """The state to start from (restored when resuming) and the checkpointer to save with."""
    keep = train_config.keep_checkpoints
    if not train_config.resume:
        checkpointer = Checkpointer(directory, keep=keep)
        existing = checkpointer.latest_step()
        if existing is not None:
            checkpointer.close()
            raise CheckpointError(
                f"{directory} already holds checkpoints (latest: step {existing}); resume from "
                "them (--resume) or choose another output directory"
            )
        return fresh, checkpointer
    checkpointer = open_for_resume(directory, keep=keep)
    try:
        state = with_config(_restore(checkpointer, fresh), train_config)
        if int(state.step) > train_config.steps:
            raise ValueError(
                f"the checkpoint is at step {int(state.step)}, past the requested steps "
                f"({train_config.steps}); ask for more steps to continue"
            )
    except BaseException:
        checkpointer.close()
        raise
    return state, checkpointer


def train(
    model_config: DeepSeekV3Config,
    train_config: TrainConfig,
    *,
    backend: str = "auto",
    out_dir: str,
    callbacks: Sequence[metrics_lib.Callback] = (),
    mesh: str | None = None,
) -> TrainResults:
    """Trains a DeepSeek-V3 model of `model_config` and writes its results into `out_dir`.

    `backend`: an MoE backend name (see `dropless.backends.BACKENDS`, or "auto").
    `train_config.resume`: continue from the latest checkpoint in `out_dir/checkpoints` (the
    model configuration must match, except its compute dtype, remat, attention implementation
    and layer unrolling; the training settings may change); the batches, and on CPU the losses,
    are exactly those of an uninterrupted run.
    `mesh` (or `train_config.mesh`; this argument wins): train on a device mesh, e.g.
    "data=2,expert=4" (see `dropless.train.sharded`): parameters and optimiser state sharded,
    batches split, the MoE layers on the "ep" backend when expert > 1; the steps equal the
    single-device ones. A mesh of one device is the single-device run.

    Raises ValueError for bad settings or data (token ids outside the vocabulary, sequences
    longer than the model supports), CheckpointError for a missing, corrupt or mismatched
    checkpoint, and TrainingDiverged when the loss becomes NaN/inf; the checkpoints saved
    before that stay.
    """
    if mesh is not None:
        train_config = dataclasses.replace(train_config, mesh=mesh)
    _validate(model_config, train_config)
    moe_backend = get_backend(backend)  # one that cannot load fails before anything is written
    device_mesh = resolve_mesh(train_config.mesh, model_config, train_config)
    _check_backend_fits_mesh(backend, moe_backend, device_mesh)
    train_data, eval_data = make_datasets(train_config, model_config.vocab_size)
    for split, dataset in (("train", train_data), ("eval", eval_data)):
        # one batch of each split, so that data too short for a window fails before any step
        # (the held-out split is otherwise first read at the first evaluation)
        _check_batch(_batch(dataset, 0, train_config, split).tokens, model_config)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    files = {
        "metrics": os.path.join(out_dir, METRICS_FILE),
        "config": os.path.join(out_dir, CONFIG_FILE),
        "summary": os.path.join(out_dir, SUMMARY_FILE),
        "checkpoints": os.path.join(out_dir, CHECKPOINT_DIR),
    }

    model = DeepSeekV3(model_config, backend=moe_backend, key=jax.random.key(train_config.seed))
    if device_mesh is not None:
        model = prepare_model(model, device_mesh)
    state = init_state(model, train_config)
    if device_mesh is not None:
        state = shard_state(state, device_mesh)  # also the `like` target of a restore
    layer_names = moe_layer_names(model)
    state, checkpointer = _open_checkpoints(files["checkpoints"], state, train_config)
    if device_mesh is not None:
        state = shard_state(state, device_mesh)  # the resumed config's numbers, replicated
    start = int(state.step)

    run_config = config_dict(model_config, train_config, backend)
    with open(files["config"], "w") as f:
        yaml.safe_dump(run_config, f, sort_keys=False)
    meta = {"config": json.loads(json.dumps(run_config))}
    writer = metrics_lib.MetricsWriter(
        files["metrics"], keep_until=start if train_config.resume else None
    )
    info = {
        "start_step": start,
        "steps": train_config.steps,
        "out_dir": out_dir,
        "backend": backend,
        "backend_resolved": resolve_backend_name(backend),
        "mesh": None if device_mesh is None else dict(device_mesh.shape),
        "n_params": sum(x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))),
    }
    callbacks = list(callbacks)
    if train_config.tensorboard:
        callbacks.append(metrics_lib.TensorBoard(os.path.join(out_dir, "tensorboard")))
    for callback in callbacks:
        callback.on_start(info)

    records: list[dict] = []
    eval_records: list[dict] = []
    tokens_per_step = train_config.batch_size * train_config.seq_len

    def run_eval(step: int) -> None:
        record = {
            "split": "eval",
            "step": step,
            **evaluate(state.model, eval_data, train_config, mesh=device_mesh),
        }
        eval_records.append(record)
        writer.write(record)
        for callback in callbacks:
            callback.on_eval(record)

    def save(step: int) -> None:
        checkpointer.save(step, state, {**meta, "step": step})
        for callback in callbacks:
            callback.on_checkpoint(step, os.path.join(files["checkpoints"], str(step)))

    def evaluated(step: int) -> bool:
        return any(r["step"] == step for r in writer.kept + eval_records if r["split"] == "eval")

    try:
        every = train_config.eval_every
        if start and every and start % every == 0 and not evaluated(start):
            run_eval(start)  # saved before its evaluation, which did not finish then
        for step in range(start, train_config.steps):
            batch = _batch(train_data, step, train_config, "train")
            _check_batch(batch.tokens, model_config)
            began = time.perf_counter()
            if device_mesh is None:
                state, step_metrics = train_step(
                    state, jnp.asarray(batch.tokens), train_config.micro_batches
                )
            else:
                tokens = sharding.shard_batch(batch.tokens, device_mesh)
                state, step_metrics = sharded_train_step(
                    device_mesh, state, tokens, train_config.micro_batches
                )
            record = _host_metrics(step_metrics)  # waits for the step
            elapsed = time.perf_counter() - began
            done = step + 1
            if not _finite(record):
                checkpointer.wait()
                raise _diverged(record, done, checkpointer)
            record = {
                "split": "train",
                "step": done,
                **record,
                "step_time": elapsed,
                "tokens_per_s": tokens_per_step / elapsed,
            }
            records.append(record)
            if done % train_config.log_every == 0 or done == train_config.steps:
                writer.write(record)
            for callback in callbacks:
                callback.on_step(record)
            # saved before evaluating: an evaluation that fails loses no training
            if train_config.checkpoint_every and done % train_config.checkpoint_every == 0:
                save(done)
            if train_config.eval_every and done % train_config.eval_every == 0:
                run_eval(done)

        final = train_config.steps
        if checkpointer.latest_step() != final:
            save(final)
        if not evaluated(final):  # a run resumed at its last step may have it already
            run_eval(final)
        checkpointer.wait()
    finally:
        writer.close()
        checkpointer.close()

    if train_config.plots:
        all_records = metrics_lib.read_jsonl(files["metrics"])
        files["loss_plot"] = os.path.join(out_dir, LOSS_PLOT)
        metrics_lib.plot_loss(all_records, files["loss_plot"])
        if layer_names:
            files["load_plot"] = os.path.join(out_dir, LOAD_PLOT)
            metrics_lib.plot_expert_load(
                np.asarray(state.expert_load), files["load_plot"], layer_names=layer_names
            )
    results = TrainResults(
        state=state,
        records=records,
        eval_records=eval_records,
        out_dir=out_dir,
        files=files,
        layer_names=layer_names,
        earlier_records=writer.kept,
    )
    with open(files["summary"], "w") as f:
        json.dump(
            {
                "steps": train_config.steps,
                "backend": info["backend_resolved"],
                "final_train": _last(writer.kept + records, "train"),
                "final_eval": results.final_eval,
                "layer_names": layer_names,
                "expert_load": results.expert_load.tolist(),
                "files": files,
            },
            f,
            indent=1,
        )
    for callback in callbacks:
        callback.on_end(results)
    return results
