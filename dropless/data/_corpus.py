"""The default corpus: real text that every Python installation carries, offline.

The documentation text of `pydoc_data.topics` (the reference manual's topics that `help()` shows),
then the standard library's own source, `.py` files in sorted order, without test suites,
installed packages, `encodings` (generated codec tables) and `pydoc_data` (the same topics again).
Capped at `max_bytes` of text. Prepared with the byte tokenizer on first use into a cache
directory named by a hash of what goes in it, and reused afterwards.
"""

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from dropless.data._prepare import prepare_documents
from dropless.data._sources import MAX_DOCUMENT_BYTES, Document, cut_texts

DEFAULT_MAX_BYTES = 16 * 2**20
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings"}
    | {"pydoc_data"}
)
_VERSION = 1  # of the recipe: a change here names a new cache directory


def default_corpus_dir(
    cache_dir: str | Path | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    eval_fraction: float = 0.02,
    progress: bool = True,
) -> Path:
    """The prepared default corpus (see the module docstring), prepared on first use.

    It lives in `cache_dir/corpus-<hash>`; `cache_dir` defaults to `$DROPLESS_CACHE`, else
    `~/.cache/dropless`. The hash covers the Python version, `max_bytes` and `eval_fraction`.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    root = Path(cache_dir or os.environ.get("DROPLESS_CACHE") or Path.home() / ".cache/dropless")
    recipe = {
        "version": _VERSION,
        "python": sys.version,
        "stdlib": _stdlib(),
        "max_bytes": max_bytes,
        "eval_fraction": eval_fraction,
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    out = root / f"corpus-{key}"
    if (out / "meta.json").is_file():
        return out
    sources = [
        {"path": "pydoc_data.topics", "type": "python-docs"},
        {"path": _stdlib(), "type": "python-stdlib"},
    ]
    try:
        prepare_documents(
            lambda: _documents(max_bytes),
            out,
            sources=sources,
            total_bytes=min(max_bytes, _total_bytes()),
            eval_fraction=eval_fraction,
            progress=progress,
        )
    except FileExistsError:  # another process prepared it meanwhile
        if not (out / "meta.json").is_file():
            raise
    return out


def corpus_texts(max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[tuple[int, str]]:
    """(source, text) of the corpus in order, until `max_bytes` of UTF-8: source 0 is a
    pydoc topic, 1 a standard-library file. The text that passes the cap is cut short."""
    left = max_bytes
    for source, text in _all_texts():
        data = text.encode("utf-8")
        if len(data) >= left:
            # cut at a character boundary: drop the continuation bytes a cut leaves
            yield source, data[:left].decode("utf-8", "ignore")
            return
        left -= len(data)
        yield source, text


def _documents(max_bytes: int) -> Iterator[Document]:
    for source, text in corpus_texts(max_bytes):
        nbytes = len(text.encode("utf-8"))
        for piece, n in cut_texts([(text, nbytes)], MAX_DOCUMENT_BYTES):
            if piece:
                yield Document(piece, source, n)


def _all_texts() -> Iterator[tuple[int, str]]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield 0, topics[name]
    for path in _stdlib_files():
        try:
            yield 1, path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # a stray non-UTF-8 or unreadable file: skip it
            continue


def _total_bytes() -> int:
    from pydoc_data.topics import topics

    docs = sum(len(t.encode("utf-8")) for t in topics.values())
    return docs + sum(p.stat().st_size for p in _stdlib_files())


def _stdlib() -> str:
    return sysconfig.get_paths()["stdlib"]


def _stdlib_files() -> Iterator[Path]:
    for root, dirs, files in os.walk(_stdlib()):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(root) / name
