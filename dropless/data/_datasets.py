"""Training data: a built-in synthetic corpus and a memory-mapped token-file loader.

Every dataset hands out batches as a pure function of (seed, step): no iterator state, so a
resumed run sees exactly the batches the uninterrupted run would have seen. Batches are numpy
arrays on the host; the loop moves them to the device.

A batch holds `window = seq_len + 1` tokens per sequence: inputs are `tokens[:, :-1]`, next-token
targets `tokens[:, 1:]`.
"""

import abc
import dataclasses
import functools
import os

import numpy as np
from jaxtyping import Int

TRAIN, EVAL = 0, 1  # split ids, mixed into the seed of each batch's random stream
_SPLITS = {"train": TRAIN, "eval": EVAL}


@dataclasses.dataclass(frozen=True)
class Batch:
    """A batch of token windows, with the language each sequence came from (-1: unknown)."""

    tokens: Int[np.ndarray, "batch window"]
    language: Int[np.ndarray, " batch"]


def _rng(seed: int, split: str, step: int) -> np.random.Generator:
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
    if step < 0 or seed < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    return np.random.default_rng([seed, _SPLITS[split], step])


class AbstractDataset(abc.ABC):
    """A source of token batches that depend only on (seed, split, step).

    A dataset fills in `batch_rows`; `batch` is the whole batch."""

    @abc.abstractmethod
    def batch_rows(
        self, step: int, rows: slice, *, seed: int, batch_size: int, seq_len: int, split: str
    ) -> Batch:
        """Rows `rows` of the batch number `step` of `split` ("train" or "eval") for this
        `seed`: one process's share of a global batch (`slice(None)`: all of it). The rows are
        those of the whole batch, whichever of them are asked for."""

    def batch(
        self, step: int, *, seed: int, batch_size: int, seq_len: int, split: str = "train"
    ) -> Batch:
        """The batch number `step` of `split` ("train" or "eval") for this `seed`."""
        return self.batch_rows(
            step, slice(None), seed=seed, batch_size=batch_size, seq_len=seq_len, split=split
        )


@dataclasses.dataclass(frozen=True)
class SyntheticCorpus(AbstractDataset):
    """A mixture of random "languages", each a first-order Markov chain over its own slice of
    the vocabulary.

    Language `l` owns the slice `[l * V / L, (l + 1) * V / L)` widened by `overlap` of its width
    on each side (so neighbouring languages share some tokens). Every token of a language has
    `branching` possible successors in that language, with Dirichlet(1) probabilities. Each
    sequence is one language, picked uniformly; it starts at a uniform token of its slice.

    A model that learns the chains reaches a loss near the chains' entropy (about 1 nat for
    `branching=4`), far below the uniform log(V); experts have languages to specialise on. The
    corpus is a pure function of its fields.
    """

    vocab_size: int
    n_languages: int = 4
    branching: int = 4
    overlap: float = 0.25
    corpus_seed: int = 0

    def __post_init__(self):
        if self.n_languages < 1:
            raise ValueError(f"n_languages must be >= 1, got {self.n_languages}")
        if self.branching < 1:
            raise ValueError(f"branching must be >= 1, got {self.branching}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")
        if self.vocab_size < 2 * self.n_languages:
            raise ValueError(
                f"vocab_size ({self.vocab_size}) must be >= 2 * n_languages "
                f"({self.n_languages}): each language needs at least two tokens"
            )

    @functools.cached_property
    def _tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(members [L m], successors [L V b], cumulative probabilities [L V b])."""
        rng = np.random.default_rng([self.corpus_seed, 0x5EED])
        v, n_lang, b = self.vocab_size, self.n_languages, self.branching
        width = v / n_lang
        pad = int(round(self.overlap * width))
        size = min(v, int(round(width)) + 2 * pad)
        members = np.empty((n_lang, size), np.int64)
        successors = np.empty((n_lang, v, b), np.int64)
        cdf = np.empty((n_lang, v, b), np.float64)
        for lang in range(n_lang):
            start = int(round(lang * width)) - pad
            members[lang] = (start + np.arange(size)) % v
            successors[lang] = members[lang][rng.integers(0, size, (v, b))]
            probs = rng.dirichlet(np.ones(b), size=v)
            cdf[lang] = np.cumsum(probs, -1)
        cdf[..., -1] = 1.0
        return members, successors, cdf

    def entropy_rate(self) -> float:
        """Mean per-token entropy (nats) of the chains: about the best loss a model can reach."""
        members, successors, cdf = self._tables
        probs = np.diff(cdf, prepend=0.0, axis=-1)
        ent = 0.0
        for lang in range(self.n_languages):
            # successor ids may repeat within a row: merge their probability first
            rows = probs[lang][members[lang]]
            ids = successors[lang][members[lang]]
            for row_p, row_ids in zip(rows, ids, strict=True):
                merged = np.bincount(row_ids, weights=row_p)
                merged = merged[merged > 0]
                ent -= np.sum(merged * np.log(merged))
        return float(ent / (self.n_languages * members.shape[1]))

    def batch_rows(
        self, step: int, rows: slice, *, seed: int, batch_size: int, seq_len: int, split: str
    ) -> Batch:
        """Draws the whole batch (each sequence continues the random stream of the ones before
        it) and keeps `rows`."""
        members, successors, cdf = self._tables
        rng = _rng(seed, split, step)
        window = seq_len + 1
        language = rng.integers(0, self.n_languages, batch_size)
        tokens = np.empty((batch_size, window), np.int64)
        tokens[:, 0] = members[language, rng.integers(0, members.shape[1], batch_size)]
        u = rng.random((batch_size, window))
        for t in range(1, window):
            prev = tokens[:, t - 1]
            choice = (u[:, t, None] > cdf[language, prev]).sum(-1)
            tokens[:, t] = successors[language, prev, choice]
        return Batch(tokens=tokens[rows].astype(np.int32), language=language[rows].astype(np.int32))


@dataclasses.dataclass(frozen=True)
class TokenFile(AbstractDataset):
    """Token windows drawn at uniform random offsets from a flat binary file of token ids
    (`uint16` or `uint32`, as written by `np.ndarray.tofile`), memory-mapped, never read whole.

    `start`/`stop` restrict the windows to a range of the file (in tokens), which is how a
    held-out tail is split off. Every batch draws its offsets from (seed, split, step).
    """

    path: str
    dtype: str = "uint16"
    start: int = 0
    stop: int | None = None

    def __post_init__(self):
        if self.dtype not in ("uint16", "uint32"):
            raise ValueError(f"token file dtype must be 'uint16' or 'uint32', got {self.dtype!r}")
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"token file not found: {self.path}")
        itemsize = np.dtype(self.dtype).itemsize
        size = os.path.getsize(self.path)
        if size == 0 or size % itemsize:
            raise ValueError(
                f"token file {self.path} has {size} bytes, not a positive multiple of "
                f"{itemsize} ({self.dtype}); is --data-dtype right?"
            )

    @functools.cached_property
    def tokens(self) -> np.memmap:
        """The whole file, memory-mapped read-only."""
        return np.memmap(self.path, dtype=self.dtype, mode="r")

    @property
    def _range(self) -> tuple[int, int]:
        stop = len(self.tokens) if self.stop is None else min(self.stop, len(self.tokens))
        return self.start, stop

    def batch_rows(
        self, step: int, rows: slice, *, seed: int, batch_size: int, seq_len: int, split: str
    ) -> Batch:
        """Reads only the windows of `rows`."""
        start, stop = self._range
        window = seq_len + 1
        if stop - start < window:
            raise ValueError(
                f"token file {self.path} holds {stop - start} tokens in [{start}, {stop}), "
                f"fewer than one window of seq_len + 1 = {window}"
            )
        offsets = _rng(seed, split, step).integers(start, stop - window + 1, batch_size)[rows]
        tokens = np.stack([np.asarray(self.tokens[o : o + window]) for o in offsets])
        return Batch(
            tokens=tokens.astype(np.int32), language=np.full((len(offsets),), -1, np.int32)
        )


def token_file_splits(
    path: str, dtype: str, *, eval_path: str | None = None, eval_fraction: float = 0.05
) -> tuple[TokenFile, TokenFile]:
    """(train, eval) datasets from token files: `eval_path` if given, else the file's tail."""
    if eval_path is not None:
        return TokenFile(path, dtype), TokenFile(eval_path, dtype)
    n = len(TokenFile(path, dtype).tokens)
    cut = int(n * (1 - eval_fraction))
    return TokenFile(path, dtype, stop=cut), TokenFile(path, dtype, start=cut)
