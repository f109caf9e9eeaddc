"""The training loop's callbacks: the `Callback` hooks, and the ones the `dropless` command uses
(evaluation lines, a tqdm progress bar, TensorBoard event files)."""

import time
import warnings

import jax

# the event JAX records when a compiled program comes from its persistent cache
COMPILE_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class Callback:
    """Hooks the training loop calls; override any of them. The loop itself never prints."""

    def on_start(self, info: dict) -> None:
        """Before the first step: `info` has start_step, steps, out_dir, n_params, backend."""

    def on_step(self, record: dict) -> None:
        """After every training step (logged to the file or not), with its metrics record."""

    def on_eval(self, record: dict) -> None:
        """After each evaluation, with its record."""

    def on_checkpoint(self, step: int, path: str) -> None:
        """After a checkpoint is started."""

    def on_end(self, results) -> None:
        """After the run (not called when it stops on an error)."""


def eval_line(record: dict) -> str:
    """One evaluation record as a line of text."""
    return (
        f"step {record['step']}: eval loss {record['loss']:.4f} "
        f"(ce {record['ce']:.4f}, max_vio {record['max_vio']:.3f})"
    )


class EvalLines(Callback):
    """Prints each evaluation as a line (`eval_line`), and nothing else: the output of a run
    without a progress bar."""

    def __init__(self, file=None):
        self._file = file

    def on_eval(self, record: dict) -> None:
        print(eval_line(record), file=self._file, flush=True)


class ProgressBar(Callback):
    """A tqdm progress bar with loss, MaxVio, tokens/s and MFU (where known); eval results as
    lines. Until the first step is done the bar says it is compiling, then a line says how long
    that took and whether JAX's persistent compile cache served it; the rate and the time left
    count only the steps after it."""

    def __init__(self, **tqdm_kwargs):
        self._kwargs = tqdm_kwargs
        self._bar = None
        self._cache_hits = 0
        self._started = 0.0

    def _count_cache_hits(self, event: str, **kwargs) -> None:
        if event == COMPILE_CACHE_HIT:
            self._cache_hits += 1

    def on_start(self, info: dict) -> None:
        from tqdm.auto import tqdm

        self._cache_hits, self._started = 0, time.perf_counter()
        jax.monitoring.register_event_listener(self._count_cache_hits)
        self._bar = tqdm(
            total=info["steps"],
            initial=info["start_step"],
            unit="step",
            desc="compiling the first step",
            **self._kwargs,
        )

    def on_step(self, record: dict) -> None:
        postfix = {
            "loss": f"{record['loss']:.3f}",
            "max_vio": f"{record['max_vio']:.2f}",
            "tok/s": f"{record['tokens_per_s']:.0f}",
        }
        if record.get("mfu") is not None:
            postfix["mfu"] = f"{100 * record['mfu']:.1f}%"
        self._bar.set_postfix(postfix, refresh=False)
        if self._bar.desc:  # the first step: compiled, its time not counted in the rate
            self._first_step_done(record["step"])
        else:
            self._bar.update(record["step"] - self._bar.n)

    def _first_step_done(self, step: int) -> None:
        jax.monitoring.unregister_event_listener(self._count_cache_hits)
        took = time.perf_counter() - self._started
        source = "loaded from the compile cache" if self._cache_hits else "compiled"
        self._bar.write(f"first step {source} in {took:.0f} s", file=self._kwargs.get("file"))
        bar = self._bar
        bar.set_description_str("", refresh=False)
        bar.n = bar.last_print_n = bar.initial = step
        bar.start_t = bar.last_print_t = time.time()  # tqdm's clock
        bar.refresh()

    def on_eval(self, record: dict) -> None:
        self._bar.write(eval_line(record), file=self._kwargs.get("file"))

    def on_end(self, results) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            if self._bar.desc:
                jax.monitoring.unregister_event_listener(self._count_cache_hits)
            self._bar.close()
            self._bar = None


class TensorBoard(Callback):
    """Writes every scalar of each record to TensorBoard event files under `log_dir`.

    Needs tensorboardX; without it, warns once and does nothing.
    """

    def __init__(self, log_dir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            warnings.warn(
                "TensorBoard logging was asked for but tensorboardX is not installed "
                "(pip install tensorboardX, or pip install 'dropless[tensorboard]'); "
                "continuing without it",
                stacklevel=2,
            )
            self._writer = None
        else:
            self._writer = SummaryWriter(log_dir)

    def _write(self, record: dict, prefix: str) -> None:
        if self._writer is None:
            return
        for name, value in record.items():
            if name != "step" and isinstance(value, int | float):
                self._writer.add_scalar(f"{prefix}/{name}", value, record["step"])

    def on_step(self, record: dict) -> None:
        self._write(record, "train")

    def on_eval(self, record: dict) -> None:
        self._write(record, "eval")

    def on_end(self, results) -> None:
        if self._writer is not None:
            self._writer.close()
