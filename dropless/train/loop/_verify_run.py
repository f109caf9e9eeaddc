"""`verify_run(run_dir)`: what `dropless verify RUN` checks, without training or evaluating.

config      config.yaml reads as a run's configs
checkpoint  each checkpoint restores and matches the SHA-256 of its arrays
data        the run's data opens (checked against its meta.json, token hashes included
            with `data_hashes`) and is the data the run recorded: same tokenizer, same
            vocabulary, same contents
"""

import dataclasses
import os
import warnings

import equinox as eqx
import jax
import yaml

from dropless.backends import jnp_backend
from dropless.data._verify import read_meta, verify_prepared
from dropless.models.deepseek_v3 import DeepSeekV3
from dropless.train.loop._data_source import open_data
from dropless.train.step._step import init_state
from dropless.train.store._checkpoint import Checkpointer, CheckpointError
from dropless.train.store._data_identity import data_changes, tokenizer_changes
from dropless.train.store._layout import CHECKPOINT_DIR, CONFIG_FILE
from dropless.train.store._run_dir import read_run_config


@dataclasses.dataclass(frozen=True)
class Check:
    """One finding: what was checked, whether it holds, and how (or why not)."""

    what: str
    ok: bool
    detail: str


def verify_run(run_dir: str | os.PathLike, *, data_hashes: bool = False) -> list[Check]:
    """Every check of the module docstring on the run in `run_dir`, in order; a config that
    does not read stops there."""
    run_dir = os.path.abspath(run_dir)
    try:
        model_config, train_config, _ = read_run_config(run_dir)
    except ValueError as err:
        return [Check("config", False, str(err))]
    checks = [Check("config", True, os.path.join(run_dir, CONFIG_FILE))]
    train_config = dataclasses.replace(train_config, mesh=None, resume=False)
    checks += _checkpoints(os.path.join(run_dir, CHECKPOINT_DIR), model_config, train_config)
    with open(os.path.join(run_dir, CONFIG_FILE)) as f:
        recorded = (yaml.safe_load(f) or {}).get("data")
    checks.append(_data(train_config, model_config.vocab_size, recorded, data_hashes))
    return checks


def _checkpoints(directory: str, model_config, train_config) -> list[Check]:
    if not os.path.isdir(directory):
        return [Check("checkpoints", False, f"{directory} does not exist")]
    backend = jnp_backend()

    def fresh():
        return init_state(DeepSeekV3(model_config, backend=backend, key=jax.random.key(0)),
                          train_config)  # fmt: skip

    like = eqx.filter_eval_shape(fresh)
    checkpointer = Checkpointer(directory)
    checks = []
    try:
        for step in checkpointer.steps():
            try:
                checkpointer.restore(like, step)
                checks.append(Check(f"checkpoint {step}", True, "digests match"))
            except CheckpointError as err:
                checks.append(Check(f"checkpoint {step}", False, str(err)))
    finally:
        checkpointer.close()
    return checks or [Check("checkpoints", False, f"no checkpoint in {directory}")]


def _data(train_config, vocab_size: int, recorded: dict | None, hashes: bool) -> Check:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            source = open_data(train_config, vocab_size)
        path = source.record.get("path")
        if hashes and path and os.path.isdir(path):
            verify_prepared(path, read_meta(path), hashes=True)
    except (ValueError, OSError) as err:
        return Check("data", False, str(err))
    changed = tokenizer_changes(recorded, source.record) + data_changes(recorded, source.record)
    if changed:
        return Check("data", False, f"differs from what the run recorded: {', '.join(changed)}")
    what = source.record.get("path", source.record["source"])
    return Check(
        "data", True, f"{what}, as recorded" + (" (token hashes checked)" if hashes else "")
    )
