"""The loop wing of `dropless.train`: setting a run up, the training loop and its guard,
preemption, multi-process runs, optimiser-state offload, metrics and callbacks, throughput, the
opened data, and what a run does after its last step.

It sits on top of the other wings (step, plan, store) and `dropless.sharding`."""

from dropless.train.loop._callbacks import Callback, EvalLines, ProgressBar, TensorBoard
from dropless.train.loop._data_source import DataSource, fit_vocab, open_data
from dropless.train.loop._distributed import initialize_from_env
from dropless.train.loop._finish import TrainResults
from dropless.train.loop._loop import TrainingDiverged, TrainingPreempted, evaluate, train
from dropless.train.loop._metrics import MetricsWriter, read_jsonl
from dropless.train.loop._run_eval import evaluate_run
from dropless.train.loop._setup import config_dict, make_datasets
from dropless.train.loop._verify_run import verify_run

__all__ = [
    "Callback",
    "DataSource",
    "EvalLines",
    "MetricsWriter",
    "ProgressBar",
    "TensorBoard",
    "TrainResults",
    "TrainingDiverged",
    "TrainingPreempted",
    "config_dict",
    "evaluate",
    "evaluate_run",
    "fit_vocab",
    "initialize_from_env",
    "make_datasets",
    "open_data",
    "read_jsonl",
    "train",
    "verify_run",
]
