"""Text to token files: `prepare(inputs, out_dir)` writes, all or nothing,

    out_dir/train.bin, eval.bin   token ids, flat (`np.ndarray.tofile`), uint16 or uint32
    out_dir/tokenizer.json        the tokenizer (Hugging Face format; tokenizer_config.json beside)
    out_dir/meta.json             sources, counts per split, tokenizer, dtype, split rule, hashes

Documents stream from the inputs to the files (never the whole corpus in memory), each followed by
the tokenizer's eos token. The same inputs and arguments give the same bytes. Everything is written
in a temporary directory beside `out_dir` and renamed into place at the end (with the user's
umask), so an error leaves nothing under `out_dir`; what a killed `prepare` leaves beside it, a
later one removes (`clean_leftovers`). The token files and the split: `dropless.data._bins`; the
temporary folder and its renaming into place: `dropless.data._staging`.
"""

import errno
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import tqdm

from dropless._files import disk_error, is_disk_error
from dropless.data._bins import SPLIT_RULE, split_fraction, write_bins
from dropless.data._sources import (
    FOLDER_EXTENSIONS,
    MAX_DOCUMENT_BYTES,
    Document,
    iter_documents,
    list_sources,
)
from dropless.data._staging import LOCK_NAME, check_out, clean_leftovers, hold, publish, umask
from dropless.data._tokenizer import (
    AbstractTokenizer,
    ByteTokenizer,
    load_tokenizer,
    token_dtype,
    train_bpe,
)

FORMAT = "dropless-prepared/1"
DEFAULT_BPE_VOCAB = 8192


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
    inputs (see `dropless.data._sources`) into `out_dir`; returns the meta.json dict.

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
    check_out(out, overwrite)
    tok, tok_meta = _resolve(tokenizer, vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    lock = hold(tmp)
    try:
        if tok is None:  # BPE: a first pass to train it on the train split
            tok = _train_bpe(documents(), tok_meta, total_bytes, eval_fraction, seed, progress)
        if tok.eos_id is None:
            raise ValueError(
                f"tokenizer {tokenizer} has no end-of-text token (none named in a "
                "tokenizer_config.json beside it, nor one of the usual names): prepare ends "
                "every document with one"
            )
        dtype = token_dtype(tok.vocab_size)
        docs = _bar(documents(), total_bytes, "encode", progress)
        counts, per_source, moved = _write(docs, tmp, tok, dtype, eval_fraction, seed, total_bytes)
        if counts["train"]["documents"] + counts["eval"]["documents"] == 0:
            paths = ", ".join(s["path"] for s in sources)
            raise ValueError(f"no documents found in the inputs ({paths}): all texts are empty")
        tok.save(tmp)
        tok_meta.update(vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id)
        split = dict(rule=SPLIT_RULE, eval_fraction=eval_fraction, seed=seed, moved_to_eval=moved)
        read = [dict(s, documents=per_source[i]) for i, s in enumerate(sources)]
        meta = _meta(tmp, dtype, tok_meta, max_document_bytes, split, read, counts)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
        (tmp / LOCK_NAME).unlink()  # held still, through the open file, until published
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp's 0700 would hide the data from others
        publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.close()
    return meta


def _train_bpe(docs, tok_meta, total_bytes, eval_fraction, seed, progress) -> AbstractTokenizer:
    """A BPE tokenizer trained on the documents of the train split."""
    texts = (d.text for d in _bar(docs, total_bytes, "train bpe", progress))
    train_texts = (t for t in texts if split_fraction(t.encode("utf-8"), seed) >= eval_fraction)
    return train_bpe(train_texts, tok_meta["requested_vocab_size"])


def _write(docs, tmp: Path, tok, dtype, eval_fraction, seed, total_bytes):
    """`write_bins`, with a full disk said in one line: the folder, its free space and about
    what the token files need."""
    try:
        return write_bins(docs, tmp, tok, dtype, eval_fraction, seed)
    except OSError as err:
        # numpy's short write says "N requested and M written", never "no space"
        if not (is_disk_error(err) or "requested and" in str(err)):
            raise
        needed = None if total_bytes is None else total_bytes * np.dtype(dtype).itemsize
        raise OSError(err.errno or errno.ENOSPC, disk_error(err, tmp.parent, needed)) from None


def _meta(tmp: Path, dtype, tok_meta, max_document_bytes, split, sources, counts) -> dict:
    """meta.json, once the files in `tmp` are written."""
    return {
        "format": FORMAT,
        "dropless_version": _version(),
        "files": {"train": "train.bin", "eval": "eval.bin", "tokenizer": "tokenizer.json"},
        "dtype": dtype,
        "tokenizer": tok_meta,
        "documents": {
            "max_bytes": max_document_bytes,
            "separator": "the eos token after every document (counted in tokens)",
        },
        "split": split,
        "sources": sources,
        **counts,
        "sha256": _hashes(tmp),
    }


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
