"""Dead experts over a window of steps: the experts that no token chose in any of a run's last
`TrainConfig.dead_expert_steps` steps, counted over every MoE layer (main stack and MTP
blocks), for each training record (`dead_experts`) and the expert-load plot.

Each expert's last chosen step is kept on the host, from each step's tokens per expert (which
the loop reads anyway): nothing on the device, whatever the window. Checkpoints carry it in
their metadata (`saved()`, `restore`), so that a resumed run counts as the uninterrupted one
does. Within a run's first `dead_expert_steps` steps the window is the steps so far.
"""

import numpy as np
from jaxtyping import Float

NEVER = np.iinfo(np.int64).min
META_KEY = "dead_experts_last_chosen"  # the checkpoint metadata's entry


class DeadExperts:
    """`tracker.update(step, tokens_per_expert) -> dead experts`: after step `step` (the
    1-based step of the training record), the experts that no token chose in steps
    `step - window + 1 ... step` (or since the first update, when fewer).

    `tokens_per_expert`: `[rows experts]`, the step's loads (`train_step`'s metric); the count
    is over all rows.
    """

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"DeadExperts: window ({window}) must be >= 1")
        self.window = window
        # per expert; NEVER: not since the first update, which is dead at once
        self.last_chosen: np.ndarray | None = None

    def update(self, step: int, tokens_per_expert: Float[np.ndarray, "rows experts"]) -> int:
        load = np.asarray(tokens_per_expert)
        if self.last_chosen is None or self.last_chosen.shape != load.shape:
            self.last_chosen = np.full(load.shape, NEVER, np.int64)
        self.last_chosen[load > 0] = step
        return int(np.sum(self.last_chosen <= step - self.window))

    def saved(self) -> list | None:
        """The state as JSON (each expert's last chosen step, None where never), or None
        before the first update."""
        if self.last_chosen is None:
            return None
        return np.where(self.last_chosen == NEVER, None, self.last_chosen).tolist()

    def restore(self, saved: list | None) -> None:
        """Continues from `saved()` (None: from nothing, as a checkpoint written before it
        was kept)."""
        if saved is None:
            self.last_chosen = None
            return
        values = np.asarray(saved, dtype=object)
        self.last_chosen = np.where(values == None, NEVER, values).astype(np.int64)  # noqa: E711
