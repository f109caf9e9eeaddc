"""Files replaced whole or not at all: write a temporary file beside the target, flush it to
disk, then rename it over the target. A process killed at any moment leaves the old file or
the new one, never a truncated mix."""

import os


def fsync_dir(directory: str) -> None:
    """Flushes a directory's entries (a rename in it) to disk, where the platform allows."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, lines) -> None:
    """Replaces `path` with the concatenation of `lines` (strings), atomically."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            for line in lines:
                f.write(line)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(directory)
