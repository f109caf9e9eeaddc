"""Stopping on SIGTERM (a scheduler's preemption notice, `kill`, `docker stop`, `timeout`) or
SIGINT (Ctrl-C): the loop finishes the step it is in, saves a checkpoint of it, and raises
`TrainingPreempted`; `--resume` continues from there. The handlers cover the whole of the
steps, from the first step's compile to the final save: a signal never interrupts a compile
(Python runs a handler between bytecodes, so the compile ends first) nor a save.

In one process, the handlers (installed for the steps only, then restored) mark the request; a
second SIGINT is a KeyboardInterrupt, for whoever cannot wait for the step to end. In a
multi-process job JAX's preemption service owns SIGTERM: any process that gets it tells the
others, and `multihost_utils.reached_preemption_sync_point` names one step at which all of them
stop, so their checkpoint shards belong to the same step; SIGINT keeps Python's default there.
"""

import signal
import threading

import jax
from jax.experimental import multihost_utils


class TrainingPreempted(RuntimeError):
    """A signal (`signal_name`) stopped the run after `step`, whose checkpoint is saved."""

    def __init__(self, step: int, signal_name: str = "SIGTERM"):
        super().__init__(f"stopped by {signal_name} after step {step}; its checkpoint is saved")
        self.step = step
        self.signal_name = signal_name


class StopOnSigterm:
    """A context for the training steps: `requested(step)` says whether to stop after `step`
    (counted from 1), the same step in every process; `signal_name` is the signal that asked."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopOnSigterm":
        # JAX's preemption service handles SIGTERM in a job of several processes; a handler
        # can only be installed from the main thread
        single = jax.process_count() == 1
        if single and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def requested(self, step: int) -> bool:
        if jax.process_count() > 1:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signal_name = self.signal_name or "SIGTERM"
                return True
            return False
        return self.signal_name is not None
