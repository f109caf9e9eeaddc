"""Files named by other files, and files that cannot be written.

A checkpoint index or a meta.json names files in its own folder: `inside` refuses any name that
would leave it (an absolute path, `..`, a separator), before anything is opened. A full disk or
a read-only one is an `OSError` deep in a write: `disk_error` turns it into one line naming the
path, and the free space needed where that is known.
"""

import errno
import os
import pathlib
import shutil

# The errors of a device that takes no more data: the user's to fix, not a bug.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


class UnsafeName(ValueError):
    """A file name, read from a file, that leaves the folder it must stay in."""


def inside(folder: str | os.PathLike, name: object, where: str) -> pathlib.Path:
    """`folder / name`, where `name` is a plain file name; UnsafeName (naming `where`, the file
    that listed it) for anything else. Symlinks in the folder are followed as usual: only the
    name is checked."""
    ok = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )
    if not ok:
        raise UnsafeName(f"{where} names the file {name!r}, which is not a plain name in {folder}")
    return pathlib.Path(folder) / name


def is_disk_error(err: BaseException) -> bool:
    """Whether `err`, or an error it was raised from, is out-of-space or a read-only target."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_ERRNOS:
            return True
        if "No space left on device" in str(err) or "Read-only file system" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system of `path` (its nearest existing parent), or None."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def human(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def disk_error(err: BaseException, path: str | os.PathLike, needed: int | None = None) -> str:
    """One line for a failed write of `path`: read-only, no permission, or out of space (with
    the free space and, when known, about how much the write needs)."""
    root = err
    while not (isinstance(root, OSError) and root.errno in DISK_ERRNOS):
        nxt = root.__cause__ or root.__context__
        if nxt is None:
            break
        root = nxt
    code = root.errno if isinstance(root, OSError) else None
    text = str(err)
    if code == errno.EROFS or "Read-only file system" in text:
        return f"cannot write {path}: the file system is read-only"
    if code in (errno.EACCES, errno.EPERM):
        return f"cannot write {path}: permission denied"
    free = free_bytes(path)
    have = "" if free is None else f"{human(free)} free"
    need = "" if needed is None else f"about {human(needed)} needed"
    amounts = ", ".join(a for a in (have, need) if a)
    return f"no space left on the device of {path}" + (f" ({amounts})" if amounts else "")
