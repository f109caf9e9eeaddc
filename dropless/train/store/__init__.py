"""The run-storage wing of `dropless.train`: checkpoints and their digests, files replaced
atomically, the run directory's lock, resuming, the compile cache, and a trained run loaded back.

It imports the step wing, not the loop."""

from dropless.train.store._checkpoint import Checkpointer, CheckpointError, open_for_resume
from dropless.train.store._compile_cache import enable_compile_cache
from dropless.train.store._lock import RunDirectoryLocked
from dropless.train.store._run_dir import LoadedRun, load_run

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "LoadedRun",
    "RunDirectoryLocked",
    "enable_compile_cache",
    "load_run",
    "open_for_resume",
]
