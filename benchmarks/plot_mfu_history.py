"""Figure: the proxy-2b train step's MFU on one H200, run by run, against the 45% target.

    python benchmarks/plot_mfu_history.py [benchmarks/results/train_step_h200_history.json]

Reads the history table (a CSV, or a JSON of benchmarks/results/ with these columns; one row
per measurement, each cited to the log that printed its step time and MFU; pallas backend,
cuDNN attention, unrolled layers, batch x 2048 tokens, command buffers on) and draws MFU in
percent against the run number, one line per (batch, micro-batches) series, each with its own
marker (so that equal points of two series both show). Rows of one run sit side by side in the
order of the table (its calls' order); each run is labelled, under its lowest point, with what
its rows changed. Writes mfu_history.png to --out.
"""

import argparse
import csv
import json
import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLUMNS = ("run", "date", "change", "batch", "micro_batches", "step_s", "mfu", "log")
TARGET = 45.0  # train-step MFU >= 45% on proxy-2b
MARKERS = "osD^vP"  # one per (batch, micro-batches) series, in turn
LABEL_WIDTH = 15  # characters per line of a run's label (runs sit about 15 characters apart)
SPREAD = 0.3  # width in runs over which one run's rows of a series are spread
NUDGE = 0.04  # runs between the series of one run, so that equal points of two stay apart


def read_rows(csv_path: pathlib.Path) -> list[dict]:
    """The history's rows, run, batch and micro-batches as ints, step time and MFU as floats."""
    if csv_path.suffix == ".json":
        rows = json.loads(csv_path.read_text())["rows"]
        columns = rows[0] if rows else ()
    else:
        with open(csv_path, newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            columns = reader.fieldnames or ()
    missing = [c for c in COLUMNS if c not in columns]
    if missing:
        raise ValueError(f"{csv_path}: missing column(s) {missing}; an MFU history has {COLUMNS}")
    for row in rows:
        for key in ("run", "batch", "micro_batches"):
            row[key] = int(row[key])
        for key in ("step_s", "mfu"):
            row[key] = float(row[key])
    return rows


def _series_label(batch: int, micro_batches: int) -> str:
    if micro_batches == 1:
        return f"batch {batch} x 2048, one pass"
    return f"batch {batch} x 2048, {micro_batches} micro-batches of {batch // micro_batches}"


def _change_label(changes: list[str]) -> str:
    """A run's changes, each later one shown as what it adds to the one before it."""
    lines = [changes[0]]
    for before, change in zip(changes, changes[1:], strict=False):
        lines.append(change[len(before) :].strip() if change.startswith(before) else f"+ {change}")
    return "\n".join(textwrap.fill(line, LABEL_WIDTH) for line in lines)


def plot(rows, out: pathlib.Path, name: str = "mfu_history.png") -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted({r["run"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 5))
    series_keys = sorted({(r["batch"], r["micro_batches"]) for r in rows})
    by_series = {k: [r for r in rows if (r["batch"], r["micro_batches"]) == k] for k in series_keys}
    # The series with rows in each run, for nudging them apart there.
    in_run = {
        run: [k for k in series_keys if any(r["run"] == run for r in by_series[k])] for run in runs
    }
    for n, key in enumerate(series_keys):
        xs, ys = [], []
        for run in runs:
            of_run = [r for r in by_series[key] if r["run"] == run]  # the table's order
            if not of_run:
                continue
            nudge = (in_run[run].index(key) - (len(in_run[run]) - 1) / 2) * NUDGE
            for i, r in enumerate(of_run):
                spread = (i - (len(of_run) - 1) / 2) * SPREAD / max(len(of_run) - 1, 1)
                xs.append(run + nudge + spread)
                ys.append(100 * r["mfu"])
        ax.plot(xs, ys, marker=MARKERS[n % len(MARKERS)], ms=4, label=_series_label(*key))
    for run in runs:
        of_run = [r for r in rows if r["run"] == run]  # the table's order
        ax.annotate(
            _change_label(list(dict.fromkeys(r["change"] for r in of_run))),
            (run, min(100 * r["mfu"] for r in of_run)),
            xytext=(0, -8),
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=7,
        )
    ax.axhline(TARGET, color="k", ls="--", lw=1, label=f"target {TARGET:.0f}%")
    ax.set_ylim(0, 50)
    ax.set_xlim(runs[0] - 0.7, runs[-1] + 0.7)
    ax.set_xticks(range(runs[0], runs[-1] + 1))
    unmeasured = [run for run in range(runs[0], runs[-1] + 1) if run not in runs]
    note = f" (no train step measured in {', '.join(map(str, unmeasured))})" if unmeasured else ""
    ax.set_xlabel(f"H200 run{note}")
    ax.set_ylabel("train-step MFU (%)")
    ax.set_title(
        "Train-step MFU, proxy-2b on one NVIDIA H200\n"
        "(pallas, cuDNN attention, unrolled layers, seq 2048, bf16)",
        fontsize=10,
    )
    ax.grid(axis="y", lw=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "csv",
        nargs="?",
        type=pathlib.Path,
        default=ROOT / "benchmarks/results/train_step_h200_history.json",
        help="the MFU history table",
    )
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs/img")
    args = parser.parse_args(argv)
    path = plot(read_rows(args.csv), args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
