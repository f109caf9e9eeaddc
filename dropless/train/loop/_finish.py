"""What `train` does after its last step: the plots, `summary.json`, and `TrainResults`."""

import dataclasses
import json
import os

import numpy as np

from dropless.models.deepseek_v3 import DeepSeekV3
from dropless.train.loop import _distributed as distributed
from dropless.train.loop import _throughput as throughput
from dropless.train.loop._metrics import read_jsonl
from dropless.train.loop._plots import plot_expert_load, plot_loss
from dropless.train.loop._setup import Run
from dropless.train.step._step import TrainState

LOSS_PLOT = "loss.png"
LOAD_PLOT = "expert_load.png"


def last_record(records: list[dict], split: str) -> dict | None:
    """The last record of `split` ("train" or "eval") in `records`, else None."""
    return next((r for r in reversed(records) if r["split"] == split), None)


@dataclasses.dataclass
class TrainResults:
    """What `train` returns. `records`/`eval_records` cover this call's steps only (the JSONL
    file holds the whole run, a resumed one included); `earlier_records` are the file's records
    from before a resume."""

    state: TrainState
    records: list[dict]
    eval_records: list[dict]
    out_dir: str
    files: dict[str, str]  # name -> path of what was written (metrics, config, checkpoints, ...)
    layer_names: list[str]  # rows of `expert_load` / `max_vio_layers`
    earlier_records: list[dict] = dataclasses.field(default_factory=list)

    @property
    def model(self) -> DeepSeekV3:
        """The trained model."""
        return self.state.model

    @property
    def losses(self) -> list[float]:
        """Training loss of each step of this call."""
        return [r["loss"] for r in self.records]

    @property
    def final_eval(self) -> dict | None:
        """The last evaluation record (at the final step), this call's or, for a run resumed
        at its last step, the earlier one."""
        return last_record(self.earlier_records + self.eval_records, "eval")

    @property
    def throughput(self) -> dict:
        """Median tokens/s and MFU (None where the peak is unknown) over this call's steps
        after its first (`dropless.train.loop._throughput.summary`)."""
        return throughput.summary(self.records)

    @property
    def expert_load(self) -> np.ndarray:
        """Tokens routed to each expert of each MoE layer, summed over the run [layers experts]."""
        return np.asarray(self.state.expert_load)


def _plot(run: Run) -> None:
    files = run.files
    files["loss_plot"] = os.path.join(run.out_dir, LOSS_PLOT)
    records = read_jsonl(files["metrics"])
    plot_loss(records, files["loss_plot"])
    if run.layer_names:
        files["load_plot"] = os.path.join(run.out_dir, LOAD_PLOT)
        dead = [
            (r["step"], r["dead_experts"])
            for r in records
            if r.get("split") == "train" and "dead_experts" in r
        ]
        plot_expert_load(
            np.asarray(run.state.expert_load),
            files["load_plot"],
            layer_names=run.layer_names,
            dead=dead,
            dead_window=run.train_config.dead_expert_steps,
        )


def _write_summary(run: Run, results: TrainResults) -> None:
    summary = {
        "steps": run.train_config.steps,
        "backend": run.info["backend_resolved"],
        **results.throughput,
        "data": None if run.data is None else run.data.record,
        "final_train": last_record(results.earlier_records + results.records, "train"),
        "final_eval": results.final_eval,
        "layer_names": run.layer_names,
        "expert_load": results.expert_load.tolist(),
        "files": run.files,
    }
    with open(run.files["summary"], "w") as f:
        json.dump(summary, f, indent=1)


def finish(run: Run, records: list[dict], eval_records: list[dict]) -> TrainResults:
    """Writes the plots (unless `TrainConfig.plots` is off) and `summary.json`, calls every
    callback's `on_end`, and returns the results of this call's `records` and `eval_records`.
    In a multi-process job, process 0 alone writes."""
    if run.train_config.plots and distributed.is_main():
        _plot(run)
    results = TrainResults(
        state=run.state,
        records=records,
        eval_records=eval_records,
        out_dir=run.out_dir,
        files=run.files,
        layer_names=run.layer_names,
        earlier_records=run.writer.kept,
    )
    if distributed.is_main():
        _write_summary(run, results)
    for callback in run.callbacks:
        callback.on_end(results)
    return results
