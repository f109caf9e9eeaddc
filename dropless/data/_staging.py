"""All or nothing: `prepare` writes into a locked temporary folder beside `out_dir` and renames
it into place (`publish`); what a killed `prepare` leaves beside `out_dir`, a later one removes
(`clean_leftovers`)."""

import fcntl
import glob
import os
import shutil
import tempfile
import time
from pathlib import Path

LOCK_NAME = ".preparing"
STALE_S = 3600  # a leftover without a lock file, older than this, is a killed prepare's


def hold(tmp: Path):
    """A lock on `tmp`, held while this process prepares into it: a later `prepare` removes
    the folders whose lock no process holds (`clean_leftovers`)."""
    f = open(tmp / LOCK_NAME, "w")  # noqa: SIM115 (closed by prepare_documents)
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return f


def umask() -> int:
    """The process's umask (read by setting it, then set back)."""
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


def check_out(out: Path, overwrite: bool):
    """Raises FileExistsError where `out` is a file, or a non-empty folder not to overwrite."""
    if out.is_file() or out.is_symlink():
        raise FileExistsError(f"output directory {out} is a file")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"output directory {out} exists and is not empty; pass overwrite=True "
            "(--overwrite) to replace it"
        )


def publish(tmp: Path, out: Path, overwrite: bool):
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
