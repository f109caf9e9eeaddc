"""The check every training step passes before it is logged or saved: a finite loss, gradient
norm and update norm, and an update no larger than `TrainConfig.max_update_ratio` times the
parameters' norm. A step that fails stops the run with `TrainingDiverged`, before its record or
any checkpoint of it is written, so the checkpoint the message names is the last good one.

The update bound: AdamW moves each parameter by about lr per step, so the update's norm is
about lr * sqrt(parameters), against the parameters' own norm of rms * sqrt(parameters). The
ratio is lr / rms(parameters): about 0.01 for the tiny preset at lr 3e-3. An update as large
as the parameters themselves (ratio 1, the default bound) replaces the model in one step: no
schedule does that on purpose, and it is what an overflowing or far too high learning rate
does, often with finite numbers (the issue this file answers saw norms of 4.5e16).
"""

import math

from dropless.models.deepseek_v3 import DeepSeekV3Config
from dropless.train._config import TrainConfig
from dropless.train.store._checkpoint import Checkpointer

WATCHED = ("loss", "grad_norm", "update_norm")  # any of them non-finite: the run diverged


class TrainingDiverged(RuntimeError):
    """A step's loss, gradient or update was non-finite or absurdly large; the run stopped
    before logging or saving it."""


def _likely_cause(
    record: dict, train_config: TrainConfig, model_config: DeepSeekV3Config, too_large: bool
) -> str:
    lr = train_config.lr
    low_precision = [
        f"{name}={getattr(model_config, name)}"
        for name in ("compute_dtype", "param_dtype", "logits_dtype")
        if getattr(model_config, name, "float32") in ("bfloat16", "float16")
    ]
    if too_large or lr > 1e-2:
        return f"the learning rate (lr={lr:g}, {record['lr']:.3g} at this step) is likely too high"
    if low_precision:
        return (
            f"likely an overflow in low precision ({', '.join(low_precision)}), or lr={lr:g} "
            "too high"
        )
    return (
        f"at lr={lr:g} the likely cause is the data (or a checkpoint that was corrupt when resumed)"
    )


def check_step(
    record: dict,
    step: int,
    train_config: TrainConfig,
    model_config: DeepSeekV3Config,
    checkpointer: Checkpointer,
) -> None:
    """Raises TrainingDiverged if step `step`'s metrics `record` fail the check."""
    bad = [f"{k}={record[k]}" for k in WATCHED if not math.isfinite(record[k])]
    ratio_bound = train_config.max_update_ratio
    too_large = (
        not bad and ratio_bound > 0 and record["update_norm"] > ratio_bound * record["param_norm"]
    )
    if not bad and not too_large:
        return
    if too_large:
        bad = [
            f"the update's norm {record['update_norm']:.3g} is over {ratio_bound:g} x the "
            f"parameters' norm {record['param_norm']:.3g} (TrainConfig.max_update_ratio)"
        ]
    checkpointer.wait()
    last = checkpointer.latest_step()
    where = (
        f"the last good checkpoint is step {last} in {checkpointer.directory}"
        if last is not None
        else "no checkpoint was saved before it"
    )
    cause = _likely_cause(record, train_config, model_config, too_large)
    raise TrainingDiverged(
        f"training diverged at step {step}: {', '.join(bad)}; {cause}. Stopped without saving "
        f"it; {where}. Lower the learning rate (or check the data) and resume "
        "(--resume, --resume-step N to pick an earlier checkpoint)."
    )
