"""Training: loss and steps, optimiser, data, checkpoints, metrics, and the loop.

from dropless.models.deepseek_v3 import get_preset
from dropless.train import TrainConfig, load_run, train

results = train(get_preset("tiny"), TrainConfig(steps=200), out_dir="runs/tiny")
run = load_run("runs/tiny")          # its configs, model and tokenizer, back from the checkpoint
"""

from dropless.data._datasets import (
    AbstractDataset,
    Batch,
    SyntheticCorpus,
    TokenFile,
    token_file_splits,
)
from dropless.train._backend_names import (
    BACKENDS,
    available_backends,
    get_backend,
    register_backend,
    resolve_backend_name,
)
from dropless.train._config import TrainConfig
from dropless.train.loop._callbacks import Callback, EvalLines, ProgressBar, TensorBoard
from dropless.train.loop._finish import TrainResults
from dropless.train.loop._loop import TrainingDiverged, TrainingPreempted, evaluate, train
from dropless.train.loop._metrics import MetricsWriter, read_jsonl
from dropless.train.loop._run_eval import evaluate_run
from dropless.train.loop._setup import config_dict, make_datasets
from dropless.train.step._cross_entropy import head_cross_entropy  # not the module's namesake
from dropless.train.step._loss import loss_terms, total_loss
from dropless.train.step._optim import (
    expert_bias_filter,
    learning_rate,
    optimizer,
    trainable_filter,
    warmup_cosine,
    weight_decay_mask,
)
from dropless.train.step._step import TrainState, eval_step, init_state, train_step
from dropless.train.store._checkpoint import Checkpointer, CheckpointError, open_for_resume
from dropless.train.store._compile_cache import enable_compile_cache
from dropless.train.store._run_dir import LoadedRun, load_run

__all__ = [
    "BACKENDS",
    "AbstractDataset",
    "Batch",
    "Callback",
    "CheckpointError",
    "Checkpointer",
    "MetricsWriter",
    "EvalLines",
    "LoadedRun",
    "ProgressBar",
    "SyntheticCorpus",
    "TensorBoard",
    "TokenFile",
    "TrainConfig",
    "TrainResults",
    "TrainState",
    "TrainingDiverged",
    "TrainingPreempted",
    "available_backends",
    "config_dict",
    "enable_compile_cache",
    "eval_step",
    "evaluate",
    "evaluate_run",
    "expert_bias_filter",
    "get_backend",
    "head_cross_entropy",
    "init_state",
    "learning_rate",
    "load_run",
    "loss_terms",
    "make_datasets",
    "open_for_resume",
    "optimizer",
    "read_jsonl",
    "register_backend",
    "resolve_backend_name",
    "token_file_splits",
    "total_loss",
    "train",
    "train_step",
    "trainable_filter",
    "warmup_cosine",
    "weight_decay_mask",
]
