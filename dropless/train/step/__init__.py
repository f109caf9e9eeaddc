"""The step wing of `dropless.train`: the loss (next-token cross-entropy plus the MoE terms),
gradient accumulation, the optimiser, and the jitted train and eval steps on one device and on
a device mesh.

It imports `dropless.train._config` and the layers below `dropless.train`, nothing else of it."""

from dropless.train.step._cross_entropy import cross_entropy, head_cross_entropy
from dropless.train.step._loss import all_moe_stats, loss_terms, total_loss
from dropless.train.step._optim import (
    expert_bias_filter,
    learning_rate,
    optimizer,
    trainable_filter,
    warmup_cosine,
    weight_decay_mask,
)
from dropless.train.step._sharded import sharded_eval_step, sharded_train_step
from dropless.train.step._sharded_grad import sharded_value_and_grad
from dropless.train.step._sharded_state import prepare_model, shard_state
from dropless.train.step._step import TrainState, eval_step, init_state, train_step

__all__ = [
    "TrainState",
    "all_moe_stats",
    "cross_entropy",
    "eval_step",
    "expert_bias_filter",
    "head_cross_entropy",
    "init_state",
    "learning_rate",
    "loss_terms",
    "optimizer",
    "prepare_model",
    "shard_state",
    "sharded_eval_step",
    "sharded_train_step",
    "sharded_value_and_grad",
    "total_loss",
    "train_step",
    "trainable_filter",
    "warmup_cosine",
    "weight_decay_mask",
]
