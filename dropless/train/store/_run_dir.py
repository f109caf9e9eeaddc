"""A trained run, loaded back: `load_run(run_dir)` reads what `train` wrote into `run_dir`.

    run = load_run("runs/tiny")                 # the latest checkpoint; step=N for another
    tokens = run.tokenizer.encode("def ")       # None for a run on the synthetic corpus
    out = generate(run.model, tokens[None], max_new_tokens=50)

The configs come from the run's `config.yaml`; the model from its checkpoint. A checkpoint holds
the whole `TrainState` (optimiser moments included): the state to fill is built abstractly with
`eqx.filter_eval_shape`, so nothing is initialised only to be overwritten, and the optimiser
state is dropped once read. The tokenizer is the `tokenizer.json` of the run's prepared data
directory (where `load_tokenizer` finds one).
"""

import dataclasses
import os
import warnings
from pathlib import Path

import equinox as eqx
import jax
import yaml

from dropless.backends import Backend
from dropless.data import default_corpus_dir
from dropless.data._tokenizer import AbstractTokenizer, load_tokenizer
from dropless.data._verify import sha256_file
from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from dropless.train._backend_names import get_backend
from dropless.train._config import TrainConfig
from dropless.train.step._step import init_state
from dropless.train.store._checkpoint import Checkpointer, CheckpointError, CorruptCheckpoint
from dropless.train.store._data_identity import DataMismatch
from dropless.train.store._layout import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    CUSTOM_BACKEND,
    METRICS_FILE,
    STDLIB,
    SYNTHETIC,
    TOKENIZER_FILE,
)


@dataclasses.dataclass
class LoadedRun:
    """A run's configs, its model at `step`, and the tokenizer of its data (None: it has none,
    e.g. a run on the synthetic corpus); `tokenizer_source` says where that came from."""

    run_dir: str
    model_config: DeepSeekV3Config
    train_config: TrainConfig
    model: DeepSeekV3
    step: int
    steps: list[int]  # every checkpointed step of the run
    backend: str  # the MoE backend name the model runs on
    tokenizer: AbstractTokenizer | None
    tokenizer_source: str | None  # the tokenizer.json read, or None

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.run_dir, METRICS_FILE)


def read_run_config(run_dir: str | os.PathLike) -> tuple[DeepSeekV3Config, TrainConfig, str]:
    """(model config, train config, backend name) from `run_dir/config.yaml`; a ValueError
    when `run_dir` is not a run directory or the file is not one that `train` writes."""
    run_dir = os.path.abspath(run_dir)
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir} is not a run directory: it does not exist")
    if not os.path.isfile(path):
        raise ValueError(
            f"{run_dir} is not a run directory: no {CONFIG_FILE} (what `dropless train` writes "
            "into its --out-dir)"
        )
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ValueError(f"{path}: expected the sections model and train of a run's config")
    model_config = _build(DeepSeekV3Config, data["model"], f"{path}: model")
    train_config = _build(TrainConfig, data.get("train") or {}, f"{path}: train")
    return model_config, train_config, str(data.get("backend", "auto"))


def _build(cls, values: dict, where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def data_dir(train_config: TrainConfig) -> Path | None:
    """The prepared data directory a run read (None for the synthetic corpus): the default
    corpus's cached folder for "stdlib", `data` itself when it is a directory, else the
    directory of its token file."""
    if train_config.data == SYNTHETIC:
        return None
    if train_config.data == STDLIB:
        return default_corpus_dir(progress=False)
    path = Path(train_config.data)
    return path if path.is_dir() else path.parent


def run_tokenizer(
    train_config: TrainConfig, recorded: dict | None = None
) -> tuple[AbstractTokenizer | None, str | None]:
    """(tokenizer, the tokenizer.json it came from) of a run's data, or (None, None) when its
    data has no tokenizer.json beside it (the synthetic corpus, a bare token file).
    `recorded`: the data record of the run's config.yaml; a tokenizer.json other than the one
    it names (the folder prepared again since) is a DataMismatch, never a wrong decoding."""
    folder = data_dir(train_config)
    if folder is None or not (folder / TOKENIZER_FILE).is_file():
        return None, None
    file = folder / TOKENIZER_FILE
    want = (recorded or {}).get("tokenizer_sha256")
    if want is not None and sha256_file(file) != want:
        raise DataMismatch(
            f"{file} is not the tokenizer the run was trained with (its SHA-256 differs from "
            "the one in the run's config.yaml): the data folder was prepared again since, and "
            "its token ids mean other text to this model"
        )
    return load_tokenizer(file), str(file.resolve())


def _recorded_data(run_dir: str) -> dict | None:
    """The data record (`DataSource.record`) of a run's config.yaml, or None."""
    with open(os.path.join(run_dir, CONFIG_FILE)) as f:
        data = (yaml.safe_load(f) or {}).get("data")
    return data if isinstance(data, dict) else None


def _restore_newest(checkpointer: Checkpointer, like, step: int | None):
    """The state of checkpoint `step`, else of the newest one that restores, retrying when a
    live run's retention removes the one being read, and passing over corrupt ones (a warning
    each)."""
    if step is not None:
        return checkpointer.restore(like, step)[0]
    tried: set[int] = set()
    last = ""
    while True:
        checkpointer.reload()
        steps = [s for s in checkpointer.steps() if s not in tried]
        if not steps:
            raise CheckpointError(
                f"no intact checkpoint in {checkpointer.directory}"
                + (f" (tried steps {sorted(tried)}; the last: {last})" if tried else "")
            )
        newest = steps[-1]
        try:
            return checkpointer.restore(like, newest)[0]
        except (CheckpointError, OSError) as err:
            tried.add(newest)
            last = str(err)
            checkpointer.reload()
            if newest not in checkpointer.steps():
                warnings.warn(
                    f"checkpoint {newest} was removed while reading (the run is training and "
                    "keeps only its newest checkpoints); retrying with the newest one",
                    stacklevel=3,
                )
            elif isinstance(err, CorruptCheckpoint):
                warnings.warn(f"{err}; trying an older checkpoint", stacklevel=3)
            else:
                raise


def _local_backend(name: str) -> str:
    """The backend to load with: the run's, where it runs without a device mesh."""
    if name == CUSTOM_BACKEND:
        return "auto"
    try:
        return "auto" if get_backend(name).expert_parallel else name
    except (ValueError, KeyError):
        return "auto"


def load_run(
    run_dir: str | os.PathLike, step: int | None = None, *, backend: str | Backend | None = None
) -> LoadedRun:
    """The run in `run_dir` with its model at checkpoint `step` (default: the latest).

    `backend`: the MoE backend to run the model on (default: the run's own; "auto" where that
    was a custom value or needs a device mesh). The model is on the default device, unsharded.
    Without `step`, the newest checkpoint that restores: one that a live run's retention removes
    while it is read is retried with the newest, a corrupt one passed over (a warning each).
    Raises ValueError when `run_dir` is not a run directory, DataMismatch when its data's
    tokenizer is no longer the one it was trained with, and CheckpointError when it has no
    checkpoint, `step` is not one of its checkpoints (the message lists those that are), or the
    checkpoint does not fit the config.
    """
    run_dir = os.path.abspath(run_dir)
    model_config, train_config, saved_backend = read_run_config(run_dir)
    directory = os.path.join(run_dir, CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint in {run_dir}: {CHECKPOINT_DIR}/ does not exist")
    name = _local_backend(saved_backend) if backend is None else backend
    tokenizer, source = run_tokenizer(train_config, _recorded_data(run_dir))
    checkpointer = Checkpointer(directory)
    try:
        steps = checkpointer.steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {directory}")
        if step is not None and step not in steps:
            raise CheckpointError(
                f"no checkpoint for step {step} in {run_dir}; available steps: "
                f"{', '.join(map(str, steps))}"
            )
        moe_backend = get_backend(name)
        train_config = dataclasses.replace(train_config, mesh=None, resume=False)

        def fresh():
            model = DeepSeekV3(model_config, backend=moe_backend, key=jax.random.key(0))
            return init_state(model, train_config)

        state = _restore_newest(checkpointer, eqx.filter_eval_shape(fresh), step)
        steps = checkpointer.steps()
    finally:
        checkpointer.close()
    return LoadedRun(
        run_dir=run_dir,
        model_config=model_config,
        train_config=train_config,
        model=state.model,
        step=int(state.step),
        steps=steps,
        backend=name if isinstance(name, str) else CUSTOM_BACKEND,
        tokenizer=tokenizer,
        tokenizer_source=source,
    )
