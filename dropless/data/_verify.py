"""A prepared data directory checked against its meta.json, and token files checked for ids
outside a vocabulary.

`verify_prepared` runs whenever a directory is opened: the sizes of train.bin and eval.bin
(tokens x the dtype's bytes) and the SHA-256 of tokenizer.json (a small file) always; the
SHA-256 of the token files, which reads them whole, on request (`dropless verify`). A folder
changed after `prepare` (a file truncated, a tokenizer copied in from elsewhere) is a
`DataChanged` error naming the file, never a run on data that means other text.
"""

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from dropless._files import UnsafeName, inside

SPLIT_FILES = {"train": "train.bin", "eval": "eval.bin"}
_CHUNK = 1 << 24  # tokens scanned at a time


class DataChanged(ValueError):
    """A prepared directory whose files differ from what its meta.json records."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def read_meta(directory: str | os.PathLike) -> dict:
    """The meta.json of a prepared directory, as a dict (ValueError when it is not JSON)."""
    path = Path(directory) / "meta.json"
    try:
        meta = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path}: not valid JSON; prepare the directory again") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a JSON object; prepare the directory again")
    return meta


def split_file(directory: str | os.PathLike, meta: dict, split: str) -> Path:
    """The token file of `split` that meta.json names (its default name where it names none),
    which stays inside `directory`."""
    files = meta.get("files") if isinstance(meta.get("files"), dict) else {}
    name = files.get(split, SPLIT_FILES[split])
    try:
        return inside(directory, name, f"{Path(directory) / 'meta.json'} (files.{split})")
    except UnsafeName as err:
        raise DataChanged(str(err)) from None


def verify_prepared(directory: str | os.PathLike, meta: dict, *, hashes: bool = False) -> None:
    """DataChanged when the files of `directory` disagree with `meta` (its meta.json): sizes,
    the tokenizer's hash, and with `hashes` the token files' hashes too. Entries that meta.json
    lacks (an older format) are not checked."""
    folder = Path(directory)
    itemsize = np.dtype(meta["dtype"]).itemsize
    recorded = meta.get("sha256") if isinstance(meta.get("sha256"), dict) else {}
    again = "it was changed after `dropless prepare`; prepare it again"
    for split in SPLIT_FILES:
        path = split_file(folder, meta, split)
        tokens = (meta.get(split) or {}).get("tokens")
        if isinstance(tokens, int) and path.is_file() and path.stat().st_size != tokens * itemsize:
            raise DataChanged(
                f"{path} has {path.stat().st_size:,} bytes; meta.json records {tokens:,} tokens "
                f"of {itemsize} bytes ({tokens * itemsize:,}): {again}"
            )
    checked = ["tokenizer.json"] + (list(SPLIT_FILES.values()) if hashes else [])
    for name in checked:
        want = recorded.get(name)
        if want is not None and (folder / name).is_file() and sha256_file(folder / name) != want:
            raise DataChanged(f"{folder / name} differs from the SHA-256 in meta.json: {again}")


def find_out_of_vocab(
    path: str | os.PathLike, dtype: str, vocab_size: int
) -> tuple[int, int] | None:
    """(offset in tokens, id) of the first id >= `vocab_size` in a token file, or None. Reads
    the file in chunks, never whole; free where the dtype cannot hold such an id."""
    if np.iinfo(np.dtype(dtype)).max < vocab_size:
        return None
    tokens = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, len(tokens), _CHUNK):
        bad = np.flatnonzero(tokens[start : start + _CHUNK] >= vocab_size)
        if bad.size:
            offset = start + int(bad[0])
            return offset, int(tokens[offset])
    return None


def check_ids(path: str | os.PathLike, dtype: str, vocab_size: int, whose: str) -> None:
    """ValueError naming the file and the offset of the first id outside a vocabulary of
    `vocab_size` (`whose`: the tokenizer's or the model's)."""
    found = find_out_of_vocab(path, dtype, vocab_size)
    if found is not None:
        offset, token = found
        itemsize = np.dtype(dtype).itemsize
        raise ValueError(
            f"{path}: token id {token} at offset {offset:,} (byte {offset * itemsize:,}) is "
            f"outside {whose} vocabulary of {vocab_size} ids; the file is corrupt or was made "
            "for another tokenizer"
        )
