"""Fault injection: SIGKILL `dropless train` at random moments, resume until done, and check
that nothing was lost, duplicated or changed.

    python benchmarks/fault_injection.py                  # 20 kills (the default)
    python benchmarks/fault_injection.py --kills 100 --seed 1
    python benchmarks/fault_injection.py --kills 2 -- --no-sample   # and a train option

A reference run trains the tiny preset uninterrupted. Then rounds: each starts a fresh run
directory and kills its process again and again, at a random moment (half of the kills at a
random time after launch: start-up, restore, compile; half once the run has logged a step:
training, checkpointing, evaluation), resuming (`--resume`, or afresh before any checkpoint)
until a process finishes. Each finished round must hold every step in `metrics.jsonl` exactly
once, every loss bit for bit equal to the reference's, and the final checkpoint. Prints the
figures and writes them, with the command and commit, to
benchmarks/results/fault_injection_cpu.json.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from dropless.train.loop import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_args(steps: int, checkpoint_every: int, more: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable, "-m", "dropless", "train",
        "--steps", str(steps), "--batch-size", "4", "--seq-len", "16", "--warmup-steps", "2",
        "--eval-every", "10", "--eval-batches", "1", "--checkpoint-every", str(checkpoint_every),
        "--backend", "jnp", "--no-progress", "--no-plots", *more,
    ]  # fmt: skip


def read_records(path: str) -> list[dict]:
    """The records of a metrics file (none before it exists; a torn last line is skipped)."""
    return read_jsonl(path) if os.path.exists(path) else []


def last_step(path: str) -> int:
    """The last training step logged in `path` (0: none)."""
    steps = [r["step"] for r in read_records(path) if r.get("split") == "train"]
    return max(steps, default=0)


def has_checkpoint(out_dir: str) -> bool:
    directory = os.path.join(out_dir, "checkpoints")
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def launch(args: list[str], out_dir: str, env: dict, log) -> subprocess.Popen:
    resume = ["--resume"] if has_checkpoint(out_dir) else []
    return subprocess.Popen(
        [*args, "--out-dir", out_dir, *resume], cwd=REPO, env=env, stdout=log, stderr=log
    )


def watch(
    process: subprocess.Popen, out_dir: str, kill_at=lambda launched, first: None
) -> tuple[bool, tuple[float, float]]:
    """Polls `process` until it exits, or SIGKILLs it once the moment `kill_at(launched,
    first)` has passed (`first`: when it logged its first step, None before; a None moment:
    not yet). Returns whether it was killed, and its spans: launch to its first logged step,
    and from there to its exit (or kill)."""
    metrics = os.path.join(out_dir, "metrics.jsonl")
    launched, first = time.time(), None
    before = last_step(metrics)
    killed = False
    while process.poll() is None:
        if first is None and last_step(metrics) > before:
            first = time.time()
        deadline = kill_at(launched, first)
        if deadline is not None and time.time() >= deadline:
            process.send_signal(signal.SIGKILL)
            process.wait()
            killed = True
            break
        time.sleep(0.05)
    first = first or time.time()
    return killed, (first - launched, time.time() - first)


def kill_at_random(
    process: subprocess.Popen, out_dir: str, rng: random.Random, spans: tuple[float, float]
) -> tuple[str | None, tuple[float, float]]:
    """SIGKILLs `process` at a random moment: half of the time within `spans[0]` of its launch
    ("start"), else within `spans[1]` of its first logged step ("train": training,
    checkpoints, evaluations). Returns the phase (None if the process ended first) and its
    spans (`watch`). `spans`: those of the last uninterrupted fresh run, so that the moments
    fall within a run as long as this one will be (a run whose programs are in the compile
    cache starts in a fraction of the time of the first, cold one)."""
    if rng.random() < 0.5:
        phase, wait = "start", rng.uniform(0.0, spans[0])
        killed, observed = watch(process, out_dir, lambda launched, first: launched + wait)
    else:
        phase, wait = "train", rng.uniform(0.0, spans[1])
        killed, observed = watch(
            process, out_dir, lambda launched, first: None if first is None else first + wait
        )
    return (phase if killed else None), observed


def check(out_dir: str, reference: dict[int, float], steps: int) -> dict:
    train = [
        r for r in read_records(os.path.join(out_dir, "metrics.jsonl")) if r.get("split") == "train"
    ]
    seen = [r["step"] for r in train]
    directory = os.path.join(out_dir, "checkpoints")
    saved = os.listdir(directory) if os.path.isdir(directory) else []
    return {
        "lost": len(set(range(1, steps + 1)) - set(seen)),
        "duplicated": len(seen) - len(set(seen)),
        "mismatches": sum(r["loss"] != reference.get(r["step"]) for r in train),
        "missing_final_checkpoint": int(str(steps) not in saved),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs in all (default 20)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=os.path.join(REPO, "benchmarks/results/fault_injection_cpu.json")
    )
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    parser.add_argument(
        "train_options", nargs=argparse.REMAINDER, help="after --: more `dropless train` options"
    )
    opts = parser.parse_args(argv)
    more = opts.train_options[1:] if opts.train_options[:1] == ["--"] else opts.train_options
    rng = random.Random(opts.seed)
    work = opts.workdir or tempfile.mkdtemp(prefix="dropless-faults-")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
           "JAX_COMPILATION_CACHE_DIR": os.path.join(work, "jax-cache")}  # fmt: skip
    args = train_args(opts.steps, opts.checkpoint_every, more)
    log = open(os.path.join(work, "log.txt"), "ab")  # noqa: SIM115

    began = time.time()
    ref_dir = os.path.join(work, "reference")
    reference_run = launch(args, ref_dir, env, log)
    _, spans = watch(reference_run, ref_dir)
    if reference_run.returncode != 0:
        raise SystemExit(f"the reference run failed; see {work}/log.txt")
    ref_records = read_records(os.path.join(ref_dir, "metrics.jsonl"))
    reference = {r["step"]: r["loss"] for r in ref_records if r["split"] == "train"}

    totals = {"kills": 0, "resumes": 0, "rounds": 0, "lost": 0, "duplicated": 0, "mismatches": 0,
              "missing_final_checkpoint": 0, "failed_processes": 0,
              "kills_by_phase": {"start": 0, "train": 0}}  # fmt: skip
    while totals["kills"] < opts.kills:
        out_dir = os.path.join(work, f"round{totals['rounds']}")
        shutil.rmtree(out_dir, ignore_errors=True)
        totals["rounds"] += 1
        while True:
            resumed = has_checkpoint(out_dir)
            totals["resumes"] += resumed
            process = launch(args, out_dir, env, log)
            phase = None
            if totals["kills"] < opts.kills:
                phase, observed = kill_at_random(process, out_dir, rng, spans)
                if phase is None and not resumed and process.returncode == 0:
                    spans = observed
            if phase is None:
                process.wait()
                if process.returncode != 0:
                    totals["failed_processes"] += 1
                    if totals["failed_processes"] > 3:
                        raise SystemExit(f"dropless train failed; see {work}/log.txt")
                    continue
                break
            totals["kills"] += 1
            totals["kills_by_phase"][phase] += 1
            print(f"kill {totals['kills']} ({phase}) in round {totals['rounds']}", flush=True)
        for name, value in check(out_dir, reference, opts.steps).items():
            totals[name] += value

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    figures = {**totals, "wall_s": round(time.time() - began, 1)}
    result = {
        "meta": {
            "benchmark": "fault_injection",
            "machine": "cpu",
            "date": time.strftime("%Y-%m-%d"),
            "commit": commit.stdout.strip(),
            "command": f"python benchmarks/fault_injection.py {argv_text}".strip(),
            "setup": " ".join(["dropless", *args[3:]]) + " --out-dir DIR [--resume]",
            "source": None,
        },
        "rows": [
            {
                "steps": opts.steps,
                "checkpoint_every": opts.checkpoint_every,
                "seed": opts.seed,
                **figures,
            }
        ],  # fmt: skip
    }
    print(json.dumps(result, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    if opts.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    row = main()["rows"][0]
    failed = ("lost", "duplicated", "mismatches", "missing_final_checkpoint")
    sys.exit(1 if any(row[name] for name in failed) else 0)
