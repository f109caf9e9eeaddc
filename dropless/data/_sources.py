"""Inputs to documents: text files, folders, `.jsonl` and `.parquet`, streamed.

A plain file is one text; a `.jsonl` line or a `.parquet` row is one text (its `text` field).
Texts longer than `max_bytes` of UTF-8 are cut into documents of at most that size, after a line
end where there is one: so a single large file streams in bounded memory, and the train/eval
split (which is per document) can hold out part of a corpus that is one file.
"""

import dataclasses
import io
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

TEXT_EXTENSIONS = (".txt", ".md", ".rst", ".py")
FOLDER_EXTENSIONS = (*TEXT_EXTENSIONS, ".jsonl", ".parquet")
MAX_DOCUMENT_BYTES = 32 * 1024


class Document(NamedTuple):
    text: str
    source: int  # index of the input it came from
    nbytes: int  # input bytes consumed since the previous document (for progress)


@dataclasses.dataclass(frozen=True)
class Source:
    """One input as given, and the files it stands for (sorted; one for a file)."""

    path: Path
    is_folder: bool
    files: tuple[Path, ...]
    nbytes: int

    def meta(self) -> dict:
        kind = "folder" if self.is_folder else "file"
        return {
            "path": str(self.path),
            "type": kind,
            "files": len(self.files),
            "bytes": self.nbytes,
        }


def list_sources(
    inputs: Iterable[str | Path], extensions: Iterable[str] = FOLDER_EXTENSIONS
) -> list[Source]:
    """Check the inputs and list their files: folders recursively in sorted order, by extension,
    skipping hidden and empty files. Raises for a missing input, an empty file, a folder with
    no files of those extensions, or `.parquet` without pyarrow."""
    extensions = tuple(e.lower() for e in extensions)
    sources = []
    for given in inputs:
        path = Path(given)
        if not path.exists():
            raise FileNotFoundError(f"input {path} does not exist")
        if not os.access(path, os.R_OK):
            raise ValueError(f"input {path} is not readable (permission denied)")
        if path.is_dir():
            files = tuple(_walk(path, extensions))
            if not files:
                raise ValueError(
                    f"input folder {path} holds no non-empty files with the extensions "
                    f"{' '.join(extensions)}"
                )
        elif path.stat().st_size == 0:
            raise ValueError(f"input file {path} is empty")
        else:
            files = (path,)
        if any(f.suffix.lower() == ".parquet" for f in files):
            _require_pyarrow(next(f for f in files if f.suffix.lower() == ".parquet"))
        size = sum(f.stat().st_size for f in files)
        sources.append(Source(path, path.is_dir(), files, size))
    if not sources:
        raise ValueError("no inputs given: name at least one file or folder")
    return sources


def iter_documents(
    sources: list[Source], max_bytes: int = MAX_DOCUMENT_BYTES
) -> Iterator[Document]:
    """The documents of `sources`, in order, never more than one file's piece in memory."""
    if max_bytes < 4:
        raise ValueError(f"max_bytes must be >= 4 (one UTF-8 character), got {max_bytes}")
    for i, source in enumerate(sources):
        for file in source.files:
            suffix = file.suffix.lower()
            if suffix in (".jsonl", ".parquet"):
                records = _jsonl(file) if suffix == ".jsonl" else _parquet(file)
                pieces = cut_texts(records, max_bytes)
            else:
                pieces = _text_file(file, max_bytes)
            pending = 0  # the bytes of skipped empty texts, for progress
            for text, nbytes in pieces:
                pending += nbytes
                if text:
                    yield Document(text, i, pending)
                    pending = 0


def cut_texts(records: Iterable[tuple[str, int]], limit: int) -> Iterator[tuple[str, int]]:
    """Cut each (text, nbytes) longer than `limit` bytes of UTF-8 as plain files are cut; a
    text's nbytes goes with its first piece."""
    for text, nbytes in records:
        if len(text) * 4 <= limit:  # short enough whatever its characters
            yield text, nbytes
            continue
        for k, piece in enumerate(_pieces(io.BytesIO(text.encode("utf-8")).read, limit)):
            yield piece.decode("utf-8"), nbytes if k == 0 else 0


def _walk(folder: Path, extensions: tuple[str, ...]) -> Iterator[Path]:
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(root) / name
            if (
                not name.startswith(".")
                and path.suffix.lower() in extensions
                and path.is_file()
                and path.stat().st_size > 0
            ):
                yield path


def _pieces(read: Callable[[int], bytes], limit: int) -> Iterator[bytes]:
    """The bytes `read(n)` gives, in pieces of at most `limit`: cut after the last line end of
    a full piece, else (one line longer than `limit`) before a character split by the cut."""
    carry = b""
    while block := carry + read(limit - len(carry)):
        cut = len(block)
        if cut == limit:  # more may follow
            cut = block.rfind(b"\n") + 1 or _whole_characters(block)
        yield block[:cut]
        carry = block[cut:]


def _whole_characters(data: bytes) -> int:
    """The length of `data` without a UTF-8 character that its end cuts (all if none is)."""
    start = len(data) - 1
    while start > len(data) - 4 and start > 0 and data[start] & 0xC0 == 0x80:
        start -= 1  # back over continuation bytes to the character's first byte
    lead = data[start]
    size = 1 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return start if start > 0 and start + size > len(data) else len(data)


def _text_file(path: Path, max_bytes: int) -> Iterator[tuple[str, int]]:
    """A plain UTF-8 file, in pieces of at most `max_bytes` cut after line ends: a file larger
    than memory streams."""
    offset = 0
    with open(path, "rb") as f:
        for piece in _pieces(f.read, max_bytes):
            yield _decode(piece, path, offset, strip_bom=offset == 0), len(piece)
            offset += len(piece)


def _decode(data: bytes, path: Path, offset: int, strip_bom: bool = False) -> str:
    try:
        return data.decode("utf-8-sig" if strip_bom else "utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"input {path} is not UTF-8 text (invalid byte at offset {offset + e.start}); "
            "convert it to UTF-8 or leave it out"
        ) from None


def _jsonl(path: Path) -> Iterator[tuple[str, int]]:
    """Each non-blank line a JSON object with a string `text` field."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            offset, start = offset + len(line), offset
            if not line.strip():
                continue
            try:
                record = json.loads(_decode(line, path, start))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(
                    f"{path}:{lineno}: each line of a .jsonl input must be a JSON object with "
                    'a string "text" field'
                )
            try:
                record["text"].encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{path}:{lineno}: text holds a lone surrogate escape") from None
            yield record["text"], len(line)


def _require_pyarrow(path: Path):
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ValueError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None


def _parquet(path: Path) -> Iterator[tuple[str, int]]:
    """The `text` column, a record batch at a time."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    if "text" not in file.schema_arrow.names:
        raise ValueError(f"{path}: a .parquet input must have a 'text' column")
    rows = max(file.metadata.num_rows, 1)
    per_row = path.stat().st_size / rows  # progress: the file's bytes, spread over its rows
    done = 0
    for batch in file.iter_batches(batch_size=1024, columns=["text"]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise ValueError(f"{path}: the 'text' column must hold strings, got {text!r:.40}")
            done += 1
            yield text, int(done * per_row) - int((done - 1) * per_row)
