"""The end-of-run PNG plots of a run: its losses and MaxVio against step, and each MoE layer's
expert load (matplotlib, imported when a plot is drawn)."""

from collections.abc import Iterable, Sequence

import numpy as np
from jaxtyping import Float


def plot_loss(records: Iterable[dict], path: str) -> None:
    """Training loss, cross-entropy and eval loss against step; MaxVio below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    fig, (ax_loss, ax_vio) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    steps = [r["step"] for r in train]
    ax_loss.plot(steps, [r["loss"] for r in train], label="loss (train)", lw=1)
    ax_loss.plot(steps, [r["ce"] for r in train], label="cross-entropy (train)", lw=1, alpha=0.7)
    if evals:
        ax_loss.plot(
            [r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="loss (eval)"
        )
    ax_loss.set_ylabel("loss (nats)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_vio.plot(steps, [r["max_vio"] for r in train], lw=1, color="tab:red")
    ax_vio.set_ylabel("MaxVio (mean over MoE layers)")
    ax_vio.set_xlabel("step")
    ax_vio.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_expert_load(
    load: Float[np.ndarray, "layers experts"],
    path: str,
    *,
    layer_names: list[str] | None = None,
    dead: Sequence[tuple[int, int]] = (),
    dead_window: int | None = None,
) -> None:
    """Heatmap of each MoE layer's expert load, relative to the layer's mean (1 = balanced);
    below it, with `dead` ((step, dead experts) of the training records), the experts no token
    chose over the last `dead_window` steps, against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load = np.asarray(load, np.float64)
    relative = load / np.maximum(load.mean(-1, keepdims=True), 1e-12)
    layers, experts = relative.shape
    width = max(5.0, 0.25 * experts + 2)
    height = max(2.5, 0.35 * layers + 1.5)
    if dead:
        fig, (ax, ax_dead) = plt.subplots(
            2, 1, figsize=(width, height + 2.5), gridspec_kw={"height_ratios": [height, 2.5]}
        )
    else:
        fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(relative, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="load / mean load")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(layers), layer_names if layer_names is not None else range(layers))
    ax.set_title("tokens routed per expert, summed over training")
    if dead:
        steps, counts = zip(*dead, strict=True)
        ax_dead.step(steps, counts, where="post", color="tab:red", lw=1)
        over = f" in the last {dead_window} steps" if dead_window else ""
        ax_dead.set_ylabel(f"dead experts (of {load.size})")
        ax_dead.set_xlabel("step")
        ax_dead.set_title(f"experts no token chose{over}, all MoE layers")
        ax_dead.set_ylim(bottom=0)
        ax_dead.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
