"""Resuming a run: pick the checkpoint (`TrainConfig.resume_step`, else the newest intact one,
passing over corrupt, empty or half-written ones with a warning each), check it was written
for this model, and warn about every setting that differs from the one it was saved with."""

import dataclasses
import json
import os
import warnings

from dropless.models.deepseek_v3._config import DROPLESS_FIELDS
from dropless.train._config import TrainConfig
from dropless.train.step._optim import learning_rate
from dropless.train.step._step import TrainState
from dropless.train.store._checkpoint import Checkpointer, CheckpointError, CorruptCheckpoint
from dropless.train.store._data_identity import check_resume_data

# Model settings that a resumed run may change: they touch no array.
FREE_ON_RESUME = tuple(f for f in DROPLESS_FIELDS if f != "param_dtype")

# TrainConfig fields whose change on resume is the point of resuming, not worth a warning.
_EXPECTED_CHANGES = ("steps", "resume", "resume_step", "allow_data_change")


def model_changes(saved: dict, fresh: TrainState) -> list[str]:
    """'field: saved -> now' for each model setting free on resume (`FREE_ON_RESUME`) that
    differs from the checkpoint's: allowed (no array changes), but said, since some (the compute
    dtype) change the numbers."""
    current = json.loads(json.dumps(dataclasses.asdict(fresh.model.config)))
    return [
        f"{k}: {saved[k]!r} -> {current[k]!r}"
        for k in FREE_ON_RESUME
        if k in saved and k in current and saved[k] != current[k]
    ]


def check_model(checkpointer: Checkpointer, step: int, fresh: TrainState) -> dict:
    """The saved run config of checkpoint `step`, after checking it was written for the same
    architecture as `fresh`."""
    saved_config = checkpointer.read_meta(step).get("config", {})
    saved = saved_config.get("model") or {}
    current = json.loads(json.dumps(dataclasses.asdict(fresh.model.config)))
    changed = [
        k for k in current if k not in FREE_ON_RESUME and k in saved and saved[k] != current[k]
    ]
    if changed:
        diffs = ", ".join(f"{k}: {saved[k]!r} -> {current[k]!r}" for k in changed)
        raise CheckpointError(
            f"cannot resume from {checkpointer.directory}: it was written for another model "
            f"configuration ({diffs})"
        )
    return saved_config


def saved_run_config(checkpoint_dir: str) -> dict | None:
    """The run config (sections backend, model, train) saved with the newest readable checkpoint
    in `checkpoint_dir`, or None where there is none: what a resumed run whose config.yaml is
    gone continues with."""
    if not os.path.isdir(checkpoint_dir):
        return None
    checkpointer = Checkpointer(checkpoint_dir)
    try:
        for step in checkpointer.steps()[::-1]:
            try:
                config = checkpointer.read_meta(step).get("config")
            except CorruptCheckpoint:
                continue
            if config:
                return config
    finally:
        checkpointer.close()
    return None


def config_changes(saved: dict, train_config: TrainConfig) -> list[str]:
    """'field: saved -> now' for each training setting that differs from the checkpoint's."""
    now = json.loads(json.dumps(dataclasses.asdict(train_config)))
    return [
        f"{k}: {saved[k]!r} -> {now[k]!r}"
        for k in now
        if k not in _EXPECTED_CHANGES and k in saved and saved[k] != now[k]
    ]


def schedule_change(saved: dict, train_config: TrainConfig, step: int) -> str | None:
    """What a resumed run with other `steps` than the checkpoint's does to the learning rate
    (None: the same steps). The warmup-cosine schedule is refit to the new `steps`, so the
    rate of the next step moves: the message says from what to what."""
    before = saved.get("steps")
    if not isinstance(before, int) or before == train_config.steps:
        return None
    old = dataclasses.replace(train_config, steps=before)
    then, now = float(learning_rate(old, step)), float(learning_rate(train_config, step))
    return (
        f"steps {before} -> {train_config.steps}: the learning-rate schedule now ends at step "
        f"{train_config.steps}, so step {step + 1} trains at lr {now:.3g} (the run's schedule: "
        f"{then:.3g})"
    )


def restore_intact(
    checkpointer: Checkpointer,
    fresh: TrainState,
    train_config: TrainConfig,
    data: dict | None = None,
) -> TrainState:
    """The state of checkpoint `train_config.resume_step`, else of the newest intact one.
    Checkpoints after the one restored are set aside (`Checkpointer.set_aside`), so that the
    run saves those steps afresh. `data`: the record of the data the run continues on, checked
    against the checkpoint's (`dropless.train.store._data_identity`) before anything is moved."""
    steps = checkpointer.steps()
    chosen = train_config.resume_step
    if chosen is not None and chosen not in steps:
        raise CheckpointError(
            f"--resume-step {chosen}: no checkpoint for step {chosen} in "
            f"{checkpointer.directory}; available: {steps}"
        )
    state, saved, step = _restore_first_intact(
        checkpointer, fresh, [chosen] if chosen is not None else steps[::-1], chosen is not None
    )
    allowed = (
        []
        if data is None
        else (
            check_resume_data(saved.get("data"), data, allow_change=train_config.allow_data_change)
        )
    )
    if allowed:
        warnings.warn(
            f"resuming on other data with the same tokenizer ({', '.join(allowed)})", stacklevel=2
        )
    changed = model_changes(saved.get("model") or {}, fresh)
    if changed:
        warnings.warn(
            "resuming with model settings that differ from the checkpoint's: " + ", ".join(changed),
            stacklevel=2,
        )
    moved = checkpointer.set_aside(step)
    if moved:
        warnings.warn(
            f"resuming from step {step}; the later checkpoints were moved to {', '.join(moved)}",
            stacklevel=2,
        )
    note = schedule_change(saved.get("train") or {}, train_config, step)
    if note:
        warnings.warn(note, stacklevel=2)
    changes = config_changes(saved.get("train") or {}, train_config)
    if changes:
        warnings.warn(
            f"resuming with settings that differ from the checkpoint's: {', '.join(changes)}",
            stacklevel=2,
        )
    return state


def _restore_first_intact(
    checkpointer: Checkpointer, fresh: TrainState, candidates: list[int], chosen: bool
) -> tuple[TrainState, dict, int]:
    """(state, saved config, step) of the first of `candidates` whose checkpoint is intact,
    warning of each skipped; a `chosen` step's corruption raises. Raises CheckpointError when
    none is intact."""
    skipped = []
    for step in candidates:
        try:
            saved = check_model(checkpointer, step, fresh)
            state, _ = checkpointer.restore(fresh, step)
        except CorruptCheckpoint as err:
            if chosen:
                raise
            skipped.append(str(err))
            # the caller of `restore_intact` is the one warned
            warnings.warn(f"{err}; trying an older checkpoint", stacklevel=3)
            continue
        return state, saved, step
    raise CheckpointError(
        f"cannot resume: no intact checkpoint in {checkpointer.directory} ("
        + "; ".join(skipped)
        + ")"
    )
