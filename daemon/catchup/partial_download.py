"""A download's file on disk while it is assembled: its pieces, a ledger of the finished ones
(so a download that stops resumes where it stopped), the sha256 of the whole, and the errors
of this node's own disk (which no donor can help with). And the progress bar it shows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from dtnode.peers.durable import write_durably

log = logging.getLogger(__name__)

PIECE_BYTES = 4 << 20  # one Range request


class TransferProgress:
    """A rich progress bar on a terminal, a log line every few seconds otherwise."""

    def __init__(self, total: int, label: str, interval: float = 2.0):
        self.total = total
        self.done = 0
        self.resumes = 0  # ranges asked again from the byte where a donor dropped the connection
        self.label = label
        self.interval = interval
        self._last_log = time.monotonic()
        self._bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, DownloadColumn, TransferSpeedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                transient=True,
            )
            self._task = self._bar.add_task(label, total=total)
            self._bar.start()

    def advance(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
        elif time.monotonic() - self._last_log >= self.interval:
            self._last_log = time.monotonic()
            log.info(
                "%s: %.1f of %.1f MB (%.0f%%)",
                self.label,
                self.done / 1e6,
                self.total / 1e6,
                100 * self.done / max(self.total, 1),
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class LocalDiskError(RuntimeError):
    """This node's own disk refused the download (full, read-only, failing): no donor is at
    fault, and no other donor would do better. Not an OSError, so no donor handler catches it."""


def _local(what: str, path: Path, e: OSError) -> LocalDiskError:
    return LocalDiskError(f"cannot {what} {path} on this node's disk: {e.strerror or e}")


class PartialDownload:
    """A file being assembled from ranges, with the list of finished pieces beside it. Every
    OSError of its own file becomes a LocalDiskError."""

    def __init__(self, scratch: Path, sha256: str, size: int):
        try:
            self._open(scratch, sha256, size)
        except OSError as e:
            raise _local("create", scratch, e) from None

    def _open(self, scratch: Path, sha256: str, size: int) -> None:
        self.path = scratch / f".download-{sha256[:16]}.partial"
        self.ledger = scratch / f".download-{sha256[:16]}.json"
        self.size = size
        self.pieces = [(start, min(PIECE_BYTES, size - start)) for start in range(0, size, PIECE_BYTES)]
        self.finished: set[int] = set()
        scratch.mkdir(parents=True, exist_ok=True)
        try:
            saved = json.loads(self.ledger.read_text())
            if saved.get("size") == size and self.path.stat().st_size == size:
                self.finished = {i for i in saved.get("pieces", []) if isinstance(i, int) and 0 <= i < len(self.pieces)}
        except (OSError, ValueError, AttributeError):
            self.finished = set()
        if not self.finished:
            with open(self.path, "wb") as f:
                f.truncate(size)
        self.fd = os.open(self.path, os.O_RDWR)

    def write(self, offset: int, data: bytes | bytearray) -> None:
        try:
            written = os.pwrite(self.fd, data, offset)
        except OSError as e:
            raise _local("write to", self.path, e) from None
        if written != len(data):
            raise LocalDiskError(f"cannot write to {self.path} on this node's disk: short write (disk full?)")

    def finish_piece(self, index: int) -> None:
        """Record a finished piece (called from worker threads: one temp file per piece)."""
        self.finished.add(index)
        tmp = self.ledger.with_name(f"{self.ledger.name}.{index}.tmp")
        try:
            write_durably(self.ledger, [json.dumps({"size": self.size, "pieces": sorted(self.finished)}).encode()], tmp)
        except OSError as e:
            raise _local("write", self.ledger, e) from None

    def sha256(self) -> str:
        digest = hashlib.sha256()
        try:
            os.fsync(self.fd)
            with open(self.path, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
        except OSError as e:
            raise _local("read back", self.path, e) from None
        return digest.hexdigest()

    def close(self) -> None:
        os.close(self.fd)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
        self.ledger.unlink(missing_ok=True)
