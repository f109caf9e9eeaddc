"""Several JAX processes in one run (one per host, or several on one machine with
`dropless train --local-processes N`): joining the job, which rows of each batch a process
reads, and who writes the run's files.

    initialize_from_env()                    # before anything touches a device
    rows = local_rows(mesh, batch_size)      # this process's rows of every global batch
    tokens = read_batch(dataset, step, train_config, "train", mesh)   # only those rows

Every process runs the same program on the same seed: the parameters are identical without a
broadcast, and `sharding.shard_batch` assembles the global batch from each process's rows
(`jax.make_array_from_process_local_data`). Process 0 alone writes metrics, plots, config.yaml
and the summary and runs the callbacks; every process writes its shards of a checkpoint
(orbax's multi-process path) and reads the metrics file of a resumed run.
"""

import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from dropless import sharding
from dropless.data._datasets import AbstractDataset
from dropless.train._config import TrainConfig
from dropless.train.loop._metrics import MetricsWriter, read_jsonl

# What `dropless train --local-processes` sets in each child (and what a launcher may set).
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"


def _cluster_detected() -> bool:
    """True inside a multi-process SLURM step (srun) or Open MPI job: `jax.distributed`
    reads the coordinator, process count and id from their variables."""
    for name in ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return True
    return False


def initialize_from_env() -> bool:
    """Joins the multi-process job the environment describes; returns whether this is one.

    `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES` and
    `JAX_PROCESS_ID` are passed to `jax.distributed.initialize`; inside an srun step of several
    tasks or an Open MPI job of several ranks it detects them itself. CPU collectives go
    through gloo. Does nothing when already initialised or when none of this is set. Must run
    before anything touches a device.
    """
    if jax.distributed.is_initialized():
        return True
    address = os.environ.get(COORDINATOR_ENV)
    if address is None and not _cluster_detected():
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if address is None:
        jax.distributed.initialize()
        return True
    try:
        count = int(os.environ[NUM_PROCESSES_ENV])
        index = int(os.environ[PROCESS_ID_ENV])
    except (KeyError, ValueError):
        raise ValueError(
            f"{COORDINATOR_ENV} is set, so {NUM_PROCESSES_ENV} and {PROCESS_ID_ENV} must be "
            "integers too (the number of processes, and this one's id from 0)"
        ) from None
    if not 0 <= index < count:
        raise ValueError(f"{PROCESS_ID_ENV} ({index}) must be in [0, {NUM_PROCESSES_ENV}={count})")
    jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=index)
    return True


def is_main() -> bool:
    """Whether this process writes the run's files and prints (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (nothing with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def local_rows(mesh: Mesh, batch_size: int) -> slice:
    """The rows of a global batch of `batch_size` that land on this process's devices (one
    contiguous range: devices are ordered by process and the batch axes are outermost)."""
    shard = NamedSharding(mesh, sharding.batch_spec(mesh))
    starts, stops = set(), set()
    for index in shard.addressable_devices_indices_map((batch_size,)).values():
        rows = index[0]
        starts.add(rows.start or 0)
        stops.add(batch_size if rows.stop is None else rows.stop)
    lo, hi = min(starts), max(stops)
    if (hi - lo) * jax.process_count() != batch_size:
        raise ValueError(
            f"mesh {dict(mesh.shape)} does not give each process one contiguous, equal share of "
            f"the batch ({batch_size} rows, {jax.process_count()} processes)"
        )
    return slice(lo, hi)


def read_batch(
    dataset: AbstractDataset, step: int, train_config: TrainConfig, split: str, mesh: Mesh | None
) -> np.ndarray:
    """The tokens of batch `step` of `split` that this process feeds: the whole batch with one
    process, else only its rows (`local_rows`), ready for `sharding.shard_batch`."""
    kwargs = dict(seed=train_config.seed, batch_size=train_config.batch_size, split=split)
    if mesh is None or jax.process_count() == 1:
        return dataset.batch(step, seq_len=train_config.seq_len, **kwargs).tokens
    rows = local_rows(mesh, train_config.batch_size)
    return dataset.batch_rows(step, rows, seq_len=train_config.seq_len, **kwargs).tokens


class ReadOnlyWriter:
    """What a process other than 0 has for a `MetricsWriter`: the same `kept` records of a
    resumed run (so every process takes the same decisions), and writes that go nowhere."""

    def __init__(self, path: str, *, keep_until: int | None = None):
        self.path = path
        self.kept: list[dict] = []
        if keep_until is not None and os.path.exists(path):
            self.kept = [r for r in read_jsonl(path) if r.get("step", 0) <= keep_until]

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def metrics_writer(path: str, *, keep_until: int | None) -> MetricsWriter | ReadOnlyWriter:
    """Process 0's `MetricsWriter`, a `ReadOnlyWriter` elsewhere. The others read a resumed
    run's records before process 0 rewrites the file (a barrier between)."""
    reader = None if is_main() else ReadOnlyWriter(path, keep_until=keep_until)
    barrier("dropless-metrics-read")
    return MetricsWriter(path, keep_until=keep_until) if reader is None else reader
