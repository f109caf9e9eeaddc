"""Stopping on SIGTERM, the signal of a scheduler's preemption notice, `kill`, `docker stop`
and `timeout`: the loop finishes the step it is in, saves a checkpoint of it, and raises
`TrainingPreempted`; `--resume` continues from there.

In one process, a SIGTERM handler (installed for the steps only, then restored) marks the
request. In a multi-process job JAX's preemption service owns SIGTERM: any process that gets
it tells the others, and `multihost_utils.reached_preemption_sync_point` names one step at
which all of them stop, so their checkpoint shards belong to the same step.
"""

import signal
import threading

import jax
from jax.experimental import multihost_utils


class TrainingPreempted(RuntimeError):
    """SIGTERM stopped the run after `step`, whose checkpoint is saved."""

    def __init__(self, step: int):
        super().__init__(f"stopped by SIGTERM after step {step}; its checkpoint is saved")
        self.step = step


class StopOnSigterm:
    """A context for the training steps: `requested(step)` says whether to stop after `step`
    (counted from 1), the same step in every process."""

    def __init__(self):
        self._received = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> "StopOnSigterm":
        # JAX's preemption service handles SIGTERM in a job of several processes; a handler
        # can only be installed from the main thread
        single = jax.process_count() == 1
        if single and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _handle(self, signum, frame) -> None:
        self._received = True

    def requested(self, step: int) -> bool:
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._received
