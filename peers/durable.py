"""Files replaced so that a crash (a kill -9, a power cut) leaves the old one or the new one whole.

`os.replace` is atomic for the name, not for the bytes: the new file's data and the directory
entry that names it reach the disk when the kernel gets to them. Without the two fsyncs a crash
right after a replace can leave an empty or truncated file under the old name.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """The directory's entries (a rename into it) on disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, final: Path) -> None:
    """`tmp` (written and closed) renamed over `final`, its bytes and the rename both on disk."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_durably(final: Path, pieces: Iterable[bytes | memoryview], tmp: Path | None = None) -> tuple[str, int]:
    """`pieces`, in order, into `final` through a temp file beside it (`tmp`, or a name of its
    own): temp file, fsync, rename, fsync the directory. Returns the bytes' (sha256, size)."""
    tmp = tmp or final.with_name(f".{final.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)
                digest.update(piece)
                size += len(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)
    return digest.hexdigest(), size
