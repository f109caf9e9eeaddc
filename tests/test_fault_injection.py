"""SIGKILL `dropless train` at random moments and resume: nothing lost, duplicated or changed
(benchmarks/fault_injection.py, a few kills; its default run makes 20)."""

import json
import os

import pytest
from helpers import load_script

import dropless

REPO = os.path.dirname(os.path.dirname(os.path.abspath(dropless.__file__)))


@pytest.mark.slow
def test_killed_and_resumed_runs_match_an_uninterrupted_one(tmp_path):
    out = tmp_path / "figures.json"
    args = ["--kills", "2", "--steps", "12", "--checkpoint-every", "3", "--out", str(out)]
    # a two-layer model without MTP compiles in half the time; no sample after the runs
    smaller = ["--model.num-hidden-layers", "2", "--model.num-nextn-predict-layers", "0"]
    # the script runs here (the runs it starts are what it tests); they import this checkout
    load_script("fault_injection").main([*args, "--", "--no-sample", *smaller])
    figures = json.loads(out.read_text())["rows"][0]
    assert figures["kills"] == 2 and figures["rounds"] >= 1
    assert figures["lost"] == figures["duplicated"] == figures["mismatches"] == 0
    assert figures["missing_final_checkpoint"] == 0


def test_check_counts_a_round_without_its_final_checkpoint(tmp_path):
    fault_injection = load_script("fault_injection")
    lines = [json.dumps({"split": "train", "step": s, "loss": 1.0}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    figures = fault_injection.check(str(tmp_path), {1: 1.0, 2: 1.0, 3: 1.0}, steps=3)
    assert figures == {"lost": 0, "duplicated": 0, "mismatches": 0, "missing_final_checkpoint": 1}
    (tmp_path / "checkpoints" / "3").mkdir()
    assert (
        fault_injection.check(str(tmp_path), {1: 1.0, 2: 1.0, 3: 1.0}, steps=3)[
            "missing_final_checkpoint"
        ]
        == 0
    )
