"""SIGKILL `dropless train` at random moments and resume: nothing lost, duplicated or changed
(benchmarks/fault_injection.py, a few kills; its default run makes 20)."""

import json
import os
import subprocess
import sys

import pytest

import dropless

REPO = os.path.dirname(os.path.dirname(os.path.abspath(dropless.__file__)))


@pytest.mark.slow
def test_killed_and_resumed_runs_match_an_uninterrupted_one(tmp_path):
    out = tmp_path / "figures.json"
    script = os.path.join(REPO, "benchmarks", "fault_injection.py")
    args = ["--kills", "3", "--steps", "12", "--checkpoint-every", "3", "--out", str(out)]
    # the script, and the runs it starts, import this checkout whatever is installed
    env = {**os.environ, "PYTHONPATH": REPO}
    subprocess.run([sys.executable, script, *args], check=True, timeout=1200, env=env)
    figures = json.loads(out.read_text())["rows"][0]
    assert figures["kills"] == 3 and figures["rounds"] >= 1
    assert figures["lost"] == figures["duplicated"] == figures["mismatches"] == 0
