"""The end-of-run plots."""

import numpy as np

from dropless.train.loop import _plots as plots


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plots_are_written(tmp_path):
    records = [
        {"split": "train", "step": s, "loss": 5 / s, "ce": 4 / s, "max_vio": 0.5 / s}
        for s in range(1, 30)
    ] + [{"split": "eval", "step": 10, "loss": 0.6}, {"split": "eval", "step": 29, "loss": 0.2}]
    plots.plot_loss(records, str(tmp_path / "loss.png"))
    load = np.random.default_rng(0).uniform(50, 150, (4, 16))
    plots.plot_expert_load(load, str(tmp_path / "load.png"), layer_names=["1", "2", "3", "mtp0"])
    dead = [(s, max(0, 10 - s)) for s in range(1, 30)]
    plots.plot_expert_load(load, str(tmp_path / "dead.png"), dead=dead, dead_window=5)
    for name in ("loss.png", "load.png", "dead.png"):
        assert _is_png(tmp_path / name) and (tmp_path / name).stat().st_size > 10_000
