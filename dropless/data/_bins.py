"""The token files of a prepared directory: every document encoded and appended, with the
eos token after it, to train.bin or eval.bin, the split decided by a hash of its text
(`SPLIT_RULE`), in batches of about `BATCH_CHARS` characters of text."""

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from dropless.data._sources import Document

SPLIT_RULE = (
    "per document: eval when the first 8 bytes of blake2b(UTF-8 text, key=str(seed)), as a "
    "fraction of 2**64, are below eval_fraction (equal texts share a split); if no document "
    "went to eval and there are at least two, the one with the smallest fraction moves there"
)
BATCH_CHARS = 1 << 20  # encode documents in batches of about this much text


def split_fraction(data: bytes, seed: int) -> float:
    """Where a document's UTF-8 bytes fall in [0, 1) (`SPLIT_RULE`): below the eval fraction,
    the document goes to eval."""
    digest = hashlib.blake2b(data, digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") / 2**64


def write_bins(docs: Iterable[Document], tmp: Path, tok, dtype, eval_fraction, seed):
    """Encode and append every document to its split's file; returns (counts per split,
    documents per source, whether the at-least-one-eval-document rule moved one)."""
    counts = {s: {"documents": 0, "bytes": 0, "tokens": 0} for s in ("train", "eval")}
    per_source = Counter()
    best = None  # (fraction, start, stop, bytes) of the train document that would go to eval
    eos = np.array([tok.eos_id], np.int64)
    with open(tmp / "train.bin", "wb") as f_train, open(tmp / "eval.bin", "wb") as f_eval:
        files = {"train": f_train, "eval": f_eval}
        for batch in _batches(docs):
            out = {"train": [], "eval": []}
            for doc, ids in zip(batch, tok.encode_batch([d.text for d in batch]), strict=True):
                data = doc.text.encode("utf-8")
                u = split_fraction(data, seed)
                split = "eval" if u < eval_fraction else "train"
                c = counts[split]
                n = len(ids) + 1
                if split == "train" and (best is None or u < best[0]):
                    best = (u, c["tokens"], c["tokens"] + n, len(data))
                out[split] += [ids, eos]
                c["documents"] += 1
                c["bytes"] += len(data)
                c["tokens"] += n
                per_source[doc.source] += 1
            for split, arrays in out.items():
                if arrays:
                    np.concatenate(arrays).astype(dtype).tofile(files[split])
    moved = counts["eval"]["documents"] == 0 and counts["train"]["documents"] >= 2
    if moved:
        _, start, stop, nbytes = best
        _move_to_eval(tmp, dtype, start, stop)
        for key, value in (("documents", 1), ("bytes", nbytes), ("tokens", stop - start)):
            counts["train"][key] -= value
            counts["eval"][key] += value
    return counts, per_source, moved


def _move_to_eval(tmp: Path, dtype: str, start: int, stop: int):
    """Move tokens [start, stop) of train.bin to eval.bin, shifting train.bin's tail down."""
    item = np.dtype(dtype).itemsize
    doc = np.fromfile(tmp / "train.bin", dtype, stop - start, offset=start * item)
    with open(tmp / "eval.bin", "ab") as f:
        doc.tofile(f)
    with open(tmp / "train.bin", "r+b") as f:
        read, write = stop * item, start * item
        while True:
            f.seek(read)
            chunk = f.read(1 << 24)
            if not chunk:
                break
            f.seek(write)
            f.write(chunk)
            read, write = read + len(chunk), write + len(chunk)
        f.truncate(write)


def _batches(docs: Iterable[Document]) -> Iterator[list[Document]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
