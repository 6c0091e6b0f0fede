"""Crash-safe file writes: a reader sees the old file or the new one, never a torn mix."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` via a temp file in the same directory: write, fsync, os.replace.

    The directory is fsynced too, so after a crash the rename itself is durable. The temp
    file is created with `mode` (subject to the umask) and removed if anything fails.
    """
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{os.urandom(3).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        dfd = os.open(p.parent, os.O_RDONLY)
    except OSError:
        return  # a directory that cannot be opened (some filesystems): the rename is still atomic
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def atomic_write_text(path: str | Path, text: str, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)
