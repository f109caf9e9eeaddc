"""Text to token files: `prepare(inputs, out_dir)` writes, all or nothing,

    out_dir/train.bin, eval.bin   token ids, flat (`np.ndarray.tofile`), uint16 or uint32
    out_dir/tokenizer.json        the tokenizer (Hugging Face format; tokenizer_config.json beside)
    out_dir/meta.json             sources, counts per split, tokenizer, dtype, split rule, hashes

Documents stream from the inputs to the files (never the whole corpus in memory), each followed by
the tokenizer's eos token. The same inputs and arguments give the same bytes. Everything is written
in a temporary directory beside `out_dir` and renamed into place at the end (with the user's
umask), so an error leaves nothing under `out_dir`; what a killed `prepare` leaves beside it, a
later one removes (`clean_leftovers`).
"""

import errno
import fcntl
import glob
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import tqdm

from dropless.data.sources import (
    FOLDER_EXTENSIONS,
    MAX_DOCUMENT_BYTES,
    Document,
    iter_documents,
    list_sources,
)
from dropless.data.tokenizer import (
    AbstractTokenizer,
    ByteTokenizer,
    load_tokenizer,
    token_dtype,
    train_bpe,
)
from dropless.files import disk_error, is_disk_error

FORMAT = "dropless-prepared/1"
DEFAULT_BPE_VOCAB = 8192
SPLIT_RULE = (
    "per document: eval when the first 8 bytes of blake2b(UTF-8 text, key=str(seed)), as a "
    "fraction of 2**64, are below eval_fraction (equal texts share a split); if no document "
    "went to eval and there are at least two, the one with the smallest fraction moves there"
)
_BATCH_CHARS = 1 << 20  # encode documents in batches of about this much text


def prepare(
    inputs: Iterable[str | Path],
    out_dir: str | Path,
    *,
    tokenizer: str | Path | AbstractTokenizer = "byte",
    vocab_size: int | None = None,
    eval_fraction: float = 0.02,
    seed: int = 0,
    extensions: Iterable[str] = FOLDER_EXTENSIONS,
    max_document_bytes: int = MAX_DOCUMENT_BYTES,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Prepare text files, folders (recursively, by `extensions`), `.jsonl` and `.parquet`
    inputs (see `dropless.data.sources`) into `out_dir`; returns the meta.json dict.

    `tokenizer`: "byte", "bpe" (trained on the train split, `vocab_size` default 8192), the path
    of a tokenizer.json (or of a directory holding one), or a tokenizer value.
    """
    sources = list_sources(inputs, extensions)
    return prepare_documents(
        lambda: iter_documents(sources, max_document_bytes),
        out_dir,
        sources=[s.meta() for s in sources],
        total_bytes=sum(s.nbytes for s in sources),
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        eval_fraction=eval_fraction,
        seed=seed,
        overwrite=overwrite,
        progress=progress,
        max_document_bytes=max_document_bytes,
    )


def prepare_documents(
    documents: Callable[[], Iterable[Document]],
    out_dir: str | Path,
    *,
    sources: list[dict],
    total_bytes: int | None = None,
    tokenizer: str | Path | AbstractTokenizer = "byte",
    vocab_size: int | None = None,
    eval_fraction: float = 0.02,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    max_document_bytes: int = MAX_DOCUMENT_BYTES,
) -> dict:
    """`prepare` for any stream of documents: `documents()` starts a fresh pass over them (BPE
    takes two); `sources[d.source]` is the meta.json entry of document `d`'s input."""
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    out = Path(out_dir)
    _check_out(out, overwrite)
    tok, tok_meta = _resolve(tokenizer, vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    lock = _hold(tmp)
    try:
        if tok is None:  # BPE: a first pass to train it on the train split
            texts = (d.text for d in _bar(documents(), total_bytes, "train bpe", progress))
            train_texts = (t for t in texts if _fraction(t.encode("utf-8"), seed) >= eval_fraction)
            tok = train_bpe(train_texts, tok_meta["requested_vocab_size"])
        if tok.eos_id is None:
            raise ValueError(
                f"tokenizer {tokenizer} has no end-of-text token (none named in a "
                "tokenizer_config.json beside it, nor one of the usual names): prepare ends "
                "every document with one"
            )
        dtype = token_dtype(tok.vocab_size)
        docs = _bar(documents(), total_bytes, "encode", progress)
        try:
            counts, per_source, moved = _write_bins(docs, tmp, tok, dtype, eval_fraction, seed)
        except OSError as err:
            # numpy's short write says "N requested and M written", never "no space"
            if not (is_disk_error(err) or "requested and" in str(err)):
                raise
            needed = None if total_bytes is None else total_bytes * np.dtype(dtype).itemsize
            raise OSError(err.errno or errno.ENOSPC, disk_error(err, out.parent, needed)) from None
        if counts["train"]["documents"] + counts["eval"]["documents"] == 0:
            paths = ", ".join(s["path"] for s in sources)
            raise ValueError(f"no documents found in the inputs ({paths}): all texts are empty")
        tok.save(tmp)
        tok_meta.update(vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id)
        meta = {
            "format": FORMAT,
            "dropless_version": _version(),
            "files": {"train": "train.bin", "eval": "eval.bin", "tokenizer": "tokenizer.json"},
            "dtype": dtype,
            "tokenizer": tok_meta,
            "documents": {
                "max_bytes": max_document_bytes,
                "separator": "the eos token after every document (counted in tokens)",
            },
            "split": {
                "rule": SPLIT_RULE,
                "eval_fraction": eval_fraction,
                "seed": seed,
                "moved_to_eval": moved,
            },
            "sources": [dict(s, documents=per_source[i]) for i, s in enumerate(sources)],
            **counts,
            "sha256": _hashes(tmp),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
        (tmp / LOCK_NAME).unlink()  # held still, through the open file, until published
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would hide the data from others
        _publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.close()
    return meta


LOCK_NAME = ".preparing"
STALE_S = 3600  # a leftover without a lock file, older than this, is a killed prepare's


def _hold(tmp: Path):
    """A lock on `tmp`, held while this process prepares into it: a later `prepare` removes
    the folders whose lock no process holds (`clean_leftovers`)."""
    f = open(tmp / LOCK_NAME, "w")  # noqa: SIM115 (closed by prepare_documents)
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return f


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def clean_leftovers(out: Path) -> list[Path]:
    """Removes what killed `prepare` runs into `out` left beside it: `.NAME.*.tmp` folders
    that no live process holds, and `.NAME.*.old` folders of a replaced `out` (moved back
    where `out` is missing: the kill fell between the two renames). Returns what it removed."""
    removed = []
    for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.*.tmp")):
        lock_file = path / LOCK_NAME
        if lock_file.is_file():
            with open(lock_file) as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a prepare at work
        elif time.time() - path.stat().st_mtime < STALE_S:
            continue  # just created, or about to be published
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.*.old")):
        if not out.exists() and (path / "data").is_dir():
            os.rename(path / "data", out)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _fraction(data: bytes, seed: int) -> float:
    digest = hashlib.blake2b(data, digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") / 2**64


def _write_bins(docs: Iterable[Document], tmp: Path, tok, dtype, eval_fraction, seed):
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
                u = _fraction(data, seed)
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
        if size >= _BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _bar(docs: Iterable[Document], total: int | None, desc: str, on: bool):
    with tqdm.tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not on) as bar:
        for doc in docs:
            yield doc
            bar.update(doc.nbytes)


def _resolve(spec, vocab_size) -> tuple[AbstractTokenizer | None, dict]:
    """(tokenizer, or None for BPE to train; its meta.json entry so far)."""
    if vocab_size is not None and not (isinstance(spec, str) and spec == "bpe"):
        raise ValueError(f"vocab_size applies to tokenizer='bpe' only, not {spec!r}")
    if isinstance(spec, AbstractTokenizer):
        return spec, {"kind": spec.kind, "source": None}
    if isinstance(spec, str) and spec == "byte":
        return ByteTokenizer(), {"kind": "byte", "source": None}
    if isinstance(spec, str) and spec == "bpe":
        requested = DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size
        return None, {"kind": "bpe", "source": None, "requested_vocab_size": requested}
    if not Path(spec).exists():
        raise FileNotFoundError(
            f"tokenizer must be 'byte', 'bpe' or the path of a tokenizer.json; "
            f"{spec} does not exist"
        )
    return load_tokenizer(spec), {"kind": "file", "source": str(spec)}


def _check_out(out: Path, overwrite: bool):
    if out.is_file() or out.is_symlink():
        raise FileExistsError(f"output directory {out} is a file")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"output directory {out} exists and is not empty; pass overwrite=True "
            "(--overwrite) to replace it"
        )


def _publish(tmp: Path, out: Path, overwrite: bool):
    """Rename `tmp` to `out`; an existing non-empty `out` (only with overwrite) is moved aside
    first and removed after, so `out` is whole at every moment it exists."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:  # appeared since the check
            raise FileExistsError(f"output directory {out} appeared while preparing")
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, old / "data")
    try:
        os.rename(tmp, out)  # replaces an empty directory
    except OSError as e:
        if old is not None:
            os.rename(old / "data", out)
        raise FileExistsError(f"output directory {out} appeared while preparing: {e}") from None
    if old is not None:
        shutil.rmtree(old)


def _hashes(folder: Path) -> dict:
    out = {}
    for name in ("train.bin", "eval.bin", "tokenizer.json"):
        h = hashlib.sha256()
        with open(folder / name, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        out[name] = h.hexdigest()
    out["all"] = hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()
    return out


def _version() -> str:
    try:
        return importlib.metadata.version("dropless")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
