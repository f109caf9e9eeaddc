"""`dropless train --local-processes N`: the same run as N JAX processes on this machine.

The launcher starts N children, `python -m dropless train <the same options> --out-dir DIR`,
each with `JAX_COORDINATOR_ADDRESS` (a free local port), `JAX_NUM_PROCESSES` and
`JAX_PROCESS_ID` set (`dropless.train.loop.initialize_from_env` joins them). Process 0
prints to this terminal; the others write `DIR/process-<i>.log`. When a child fails, the others
are stopped (SIGTERM, then SIGKILL after `GRACE_S`) and the launcher exits with 1 naming it.
A SIGTERM to the launcher goes to every child: they stop after one common step, saved
(`dropless.train.loop._preempt`), and the launcher exits with 143 once all have.
Each child sees the devices the environment gives it (on a CPU,
`XLA_FLAGS=--xla_force_host_platform_device_count=4` gives each 4).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from dropless.cli._options import TrainCommand
from dropless.cli._run import run_name
from dropless.train.loop import _distributed as distributed

FLAG = "--local-processes"
# How long a stopped child may take to exit before it is killed. Short: a child left waiting
# in a collective by its failed peer never reaches the step at which JAX acts on a SIGTERM.
GRACE_S = 3.0
PROCESSES_FILE = "local-processes.json"  # the children's pids, for tools and tests


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_args(args: Sequence[str], out_dir: str) -> list[str]:
    """`args` (after `train`) without --local-processes, with --out-dir set to `out_dir`."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == FLAG:
            skip = True
        elif not arg.startswith(FLAG + "="):
            kept.append(arg)
    return [*kept, "--out-dir", out_dir]


def _stop(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


class _ForwardSigterm:
    """The launcher's SIGTERM handler: passes the signal on to every running child."""

    def __init__(self, children: list[subprocess.Popen]):
        self.children, self.received = children, False

    def __call__(self, signum, frame) -> None:
        self.received = True
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)


def _env(index: int, count: int, address: str) -> dict[str, str]:
    env = dict(os.environ)
    env[distributed.COORDINATOR_ENV] = address
    env[distributed.NUM_PROCESSES_ENV] = str(count)
    env[distributed.PROCESS_ID_ENV] = str(index)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch(args: Sequence[str], count: int, out_dir: str) -> int:
    """Runs `dropless train args` as `count` processes writing `out_dir`; returns the exit
    status: 0 when all succeed, 1 when one fails (the others are stopped), 130 on Ctrl-C."""
    if count < 1:
        raise ValueError(f"{FLAG} must be >= 1, got {count}")
    os.makedirs(out_dir, exist_ok=True)
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "dropless", "train", *child_args(args, out_dir)]
    children, logs = [], []
    forward = _ForwardSigterm(children)
    previous = signal.signal(signal.SIGTERM, forward)
    try:
        for i in range(count):
            log = None if i == 0 else os.path.join(out_dir, f"process-{i}.log")
            out = None if log is None else open(log, "w")  # noqa: SIM115 (closed below)
            logs.append((log, out))
            children.append(
                subprocess.Popen(command, env=_env(i, count, address), stdout=out, stderr=out)
            )
        with open(os.path.join(out_dir, PROCESSES_FILE), "w") as f:
            json.dump({"coordinator": address, "pids": [c.pid for c in children]}, f)
        return _watch(children, logs, forward, out_dir)
    except KeyboardInterrupt:
        _stop(children)
        print("dropless: interrupted; stopped every process", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        for _, out in logs:
            if out is not None:
                out.close()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _watch(
    children: list[subprocess.Popen], logs: list, forward: _ForwardSigterm, out_dir: str
) -> int:
    """Waits for every child; the first failure stops the rest. After a SIGTERM, a child that
    stopped for it (or was killed by it, before it could save) is no failure."""
    stopped = (0, 128 + signal.SIGTERM, -signal.SIGTERM)
    while True:
        codes = [child.poll() for child in children]
        if all(code == 0 for code in codes):
            return 0
        if forward.received and all(code is not None for code in codes):
            print(
                f"dropless: stopped by SIGTERM; continue with: dropless train --out-dir {out_dir} "
                f"--resume --local-processes {len(children)}",
                file=sys.stderr,
                flush=True,
            )
            return 128 + signal.SIGTERM
        ok = stopped if forward.received else (0,)
        failed = [i for i, code in enumerate(codes) if code is not None and code not in ok]
        if failed:
            i = failed[0]
            where = f" (its output: {logs[i][0]})" if logs[i][0] else ""
            print(
                f"dropless: error: process {i} of {len(children)} {_describe_exit(codes[i])}"
                f"{where}; stopping the other processes",
                file=sys.stderr,
                flush=True,
            )
            _stop(children)
            return 1
        time.sleep(0.2)


def run_local(command: TrainCommand, args: Sequence[str]) -> int:
    """`dropless train args` (without the `train`) with `command.local_processes` > 1: picks
    the output directory (as a single-process run would), then `launch`es."""
    if command.configs()[1].resume and command.out_dir is None:
        raise ValueError("--resume needs --out-dir (the directory of the run to continue)")
    name = run_name(command, command.configs()[1].resume)
    out_dir = command.out_dir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    print(
        f"dropless: starting {command.local_processes} processes on this machine -> {out_dir} "
        f"(process 0 prints here; the others write {out_dir}/process-<i>.log)",
        flush=True,
    )
    return launch(args, command.local_processes, out_dir)
