"""Metrics: the run's JSONL log, written and read back. The end-of-run plots are in
`dropless.train.loop._plots`, the loop's callbacks (progress bar, TensorBoard) in
`dropless.train.loop._callbacks`.

Each line of `metrics.jsonl` is one record; training records have `"split": "train"` and
carry step, loss, ce, mtp, balance_loss, seq_balance_loss, global_balance_loss, z_loss,
max_vio, dropped, router_entropy, unused_experts, active_experts (router diagnostics: see
`dropless.train.step.train_step`), dead_experts (experts no token chose over the last
`TrainConfig.dead_expert_steps` steps: `dropless.train.loop._dead_experts`), grad_norm,
update_norm, param_norm, lr, max_vio_layers (one per MoE layer), step_time, tokens_per_s and mfu
(`dropless.train.loop._throughput`; null where the device's peak is unknown); evaluation
records have `"split": "eval"`.
"""

import contextlib
import json
import os

from dropless._files import disk_error
from dropless.train.store._atomic import write_atomic


class MetricsWriter:
    """Appends records to a JSONL file, one line each, flushed as written.

    `keep_until`: on opening, drop the existing records with a larger step (a resumed run
    rewrites the steps after its checkpoint); None starts the file afresh. `kept`: the records
    kept. The file is never truncated in place: the kept records are written to a temporary
    file that replaces it (`dropless.train.store._atomic`), so a kill while resuming loses nothing.
    """

    def __init__(self, path: str, *, keep_until: int | None = None):
        self.path = path
        self.kept: list[dict] = []
        if keep_until is not None and os.path.exists(path):
            self.kept = [r for r in read_jsonl(path) if r.get("step", 0) <= keep_until]
        write_atomic(path, (json.dumps(record) + "\n" for record in self.kept))
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def write(self, record: dict) -> None:
        """Appends `record` as one line; a write that fails (a full disk) leaves no part of
        the line behind, and is an OSError of one line naming the file."""
        data = (json.dumps(record) + "\n").encode()
        end = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)  # never a torn line
            raise OSError(err.errno, disk_error(err, self.path)) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_jsonl(path: str) -> list[dict]:
    """All records of a JSONL file (a torn last line, from a killed run, is skipped)."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
