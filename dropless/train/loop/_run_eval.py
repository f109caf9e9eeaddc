"""Evaluating a loaded run: `evaluate_run(load_run(dir))` -> loss, perplexity, bits per byte.

The numbers come from the trainer's own evaluation (`loop.evaluate`, the eval step of
`dropless.train.step._step`), on the run's eval split with its batch shape and number of batches
(the batches its evaluations saw), or on another prepared directory's `eval.bin`.
"""

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Literal

import numpy as np

from dropless.data._datasets import AbstractDataset, Batch, TokenFile
from dropless.data._tokenizer import AbstractTokenizer, ByteTokenizer, load_tokenizer
from dropless.data._verify import read_meta, split_file, verify_prepared
from dropless.train._config import TrainConfig
from dropless.train.loop import _setup as setup
from dropless.train.loop._loop import evaluate
from dropless.train.store._layout import TOKENIZER_FILE
from dropless.train.store._run_dir import LoadedRun

EVAL_CLI_SPLIT = "eval_cli"  # the `split` of the records `append_metrics` writes


def prepared_eval_split(directory: str | os.PathLike) -> TokenFile:
    """The eval split (`eval.bin`) of a directory that `dropless prepare` wrote."""
    folder = Path(directory)
    meta_file = folder / "meta.json"
    if not meta_file.is_file():
        raise ValueError(
            f"{folder} is not a prepared data directory: no meta.json (`dropless prepare` "
            "writes one)"
        )
    meta = read_meta(folder)
    eval_file = split_file(folder, meta, "eval")  # never a file outside `folder`
    verify_prepared(folder, meta)
    if not eval_file.is_file() or eval_file.stat().st_size == 0:
        raise ValueError(f"{folder} has no eval split ({eval_file.name} is missing or empty)")
    return TokenFile(str(eval_file), meta["dtype"])


def count_bytes(tokenizer: AbstractTokenizer, tokens: np.ndarray) -> int:
    """UTF-8 bytes of the text that `tokens` ([rows n]) stand for, special tokens excluded.

    Byte tokenizer: one byte per id below 256, exactly. Others: each row decoded; a character
    that a row's ends cut in two counts as one replacement character (3 bytes), at most two
    per row."""
    if isinstance(tokenizer, ByteTokenizer):
        return int(np.count_nonzero(tokens < 256))
    return sum(
        len(tokenizer.decode(row, skip_special_tokens=True).encode("utf-8")) for row in tokens
    )


def evaluate_run(
    run: LoadedRun,
    *,
    data: str | os.PathLike | None = None,
    batches: int | Literal["all"] | None = None,
    batch_size: int | None = None,
) -> dict:
    """Cross-entropy, perplexity and bits per byte of `run.model` on `batches` batches (default:
    the run's `eval_batches`) of `batch_size` windows (default: the run's) of its `seq_len`;
    `batches="all"`: the whole eval split once, in consecutive windows (the few tokens after
    the last whole window left out), the last batch smaller.

    `data`: a prepared directory whose eval split to read (default: the run's own eval data).
    Bits per byte = total nats / ln 2 / total UTF-8 bytes, the bytes being those of exactly the
    target tokens scored (`count_bytes`, from the tokenizer); not meta.json's average
    bytes-per-token ratio, which describes the whole split rather than the windows drawn. It is
    None where no tokenizer is known (the synthetic corpus). The result also holds every loss
    term of the trainer's evaluation (`loss` is theirs, `ce` the cross-entropy).
    """
    config = _eval_config(run.train_config, None if batches == "all" else batches, batch_size)
    dataset, tokenizer, source = _eval_data(run, data)
    began = time.perf_counter()
    parts = [(dataset, config)] if batches != "all" else _whole_split(dataset, config)
    targets, terms = [], {}
    for part, part_config in parts:
        scored = [
            setup.batch(part, i, part_config, "eval").tokens[:, 1:]
            for i in range(part_config.eval_batches)
        ]
        share = sum(t.size for t in scored)
        for name, value in evaluate(run.model, part, part_config).items():
            terms[name] = terms.get(name, 0.0) + value * share
        targets += scored
    targets = np.concatenate(targets)
    terms = {name: value / targets.size for name, value in terms.items()}
    n_bytes = None if tokenizer is None else count_bytes(tokenizer, targets)
    nats = terms["ce"] * targets.size
    return {
        "step": run.step,
        "data": source,
        "batches": sum(c.eval_batches for _, c in parts),
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "tokens": int(targets.size),
        "bytes": n_bytes,
        **terms,
        "perplexity": math.exp(terms["ce"]),
        "bits_per_byte": nats / math.log(2) / n_bytes if n_bytes else None,
        "eval_time": time.perf_counter() - began,
    }


def scored_windows(
    run: LoadedRun,
    *,
    data: str | os.PathLike | None = None,
    batches: int | Literal["all"] | None = None,
    batch_size: int | None = None,
) -> list[np.ndarray]:
    """The windows `evaluate_run` scores with these arguments, batch by batch ([rows
    seq_len + 1] each: inputs `[:, :-1]`, targets `[:, 1:]`)."""
    config = _eval_config(run.train_config, None if batches == "all" else batches, batch_size)
    dataset, _, _ = _eval_data(run, data)
    parts = [(dataset, config)] if batches != "all" else _whole_split(dataset, config)
    return [
        setup.batch(part, i, part_config, "eval").tokens
        for part, part_config in parts
        for i in range(part_config.eval_batches)
    ]


@dataclasses.dataclass(frozen=True)
class ConsecutiveWindows(AbstractDataset):
    """A token file's range read in order: batch `step` holds windows `first + step *
    batch_size + [0, batch_size)`, window i being tokens `[i seq_len, (i + 1) seq_len]` of the
    range (one token shared with the next window, so every token after the first is a
    target once). The seed and split are ignored."""

    source: TokenFile
    first: int = 0

    def batch_rows(
        self, step: int, rows: slice, *, seed: int, batch_size: int, seq_len: int, split: str
    ) -> Batch:
        begin = self.source.start + (self.first + step * batch_size) * seq_len
        picked = range(batch_size)[rows]
        windows = [
            np.asarray(self.source.tokens[begin + j * seq_len : begin + (j + 1) * seq_len + 1])
            for j in picked
        ]
        tokens = np.stack(windows).astype(np.int32)
        return Batch(tokens=tokens, language=np.full((len(picked),), -1, np.int32))


def _whole_split(
    dataset: AbstractDataset, config: TrainConfig
) -> list[tuple[AbstractDataset, TrainConfig]]:
    """(dataset, config) pairs that together score every whole window of `dataset` once: the
    full batches, then the rest in one smaller batch."""
    if not isinstance(dataset, TokenFile):
        raise ValueError("batches='all' needs a token file's eval split (not the synthetic corpus)")
    stop = len(dataset.tokens) if dataset.stop is None else min(dataset.stop, len(dataset.tokens))
    windows = (stop - dataset.start - 1) // config.seq_len
    if windows < 1:
        raise ValueError(
            f"the eval split holds fewer than seq_len + 1 = {config.seq_len + 1} tokens"
        )
    full, rest = divmod(windows, config.batch_size)
    parts = []
    if full:
        parts.append((ConsecutiveWindows(dataset), dataclasses.replace(config, eval_batches=full)))
    if rest:
        last = dataclasses.replace(config, eval_batches=1, batch_size=rest, micro_batches=1)
        parts.append((ConsecutiveWindows(dataset, full * config.batch_size), last))
    return parts


def append_metrics(path: str | os.PathLike, record: dict, split: str = EVAL_CLI_SPLIT) -> dict:
    """Appends `record` as `{"split": split, ...}` to a metrics.jsonl in one write, so that
    the lines already there cannot be lost; returns the line's record."""
    line = {"split": split, **record}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    return line


def _eval_config(
    train_config: TrainConfig, batches: int | None, batch_size: int | None
) -> TrainConfig:
    changes = {"mesh": None}
    if batches is not None:
        if batches < 1:
            raise ValueError(f"batches must be >= 1, got {batches}")
        changes["eval_batches"] = batches
    if batch_size is not None:
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        changes["batch_size"] = batch_size
        if batch_size % train_config.micro_batches:  # evaluated in one pass then
            changes["micro_batches"] = 1
    return dataclasses.replace(train_config, **changes)


def _eval_data(
    run: LoadedRun, data: str | os.PathLike | None
) -> tuple[AbstractDataset, AbstractTokenizer | None, str]:
    """(eval dataset, its tokenizer, what to call it) for `evaluate_run`."""
    if data is None:
        _, dataset = setup.make_datasets(run.train_config, run.model_config.vocab_size)
        return dataset, run.tokenizer, run.train_config.data
    dataset = prepared_eval_split(data)
    tokenizer = None
    if (Path(data) / TOKENIZER_FILE).is_file():
        tokenizer = load_tokenizer(Path(data) / TOKENIZER_FILE)
    if run.tokenizer is not None and tokenizer is not None and tokenizer != run.tokenizer:
        raise ValueError(
            f"{data} was prepared with another tokenizer than the run's ({run.tokenizer_source})"
            ": its token ids mean other text to this model"
        )
    return dataset, tokenizer, str(Path(data).resolve())
