"""The current step's checkpoint served straight from θ_g in memory, no file written."""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from dtnode.daemon.checkpoints.file_format import CheckpointInfo, Layout, shared_header

WRITE_SLICE = 64 << 20  # bytes of the file read from the tensors at a time when it is written


class MemoryCheckpoint:
    """`ckpt-N` of the current step served straight from θ_g and the momentum in memory.

    Byte for byte the file `write_checkpoint` would write (so the same sha256: donors serving
    from memory and from disk are one file to a joiner), without writing it: a joiner asks
    for the current step at any moment, and a donor that had to write it first kept it
    waiting for seconds. It reads the live CPU tensors, which change only at an outer step;
    the node calls `detach` before that step when a joiner may still be reading, which swaps
    in copies, and forgets it otherwise.
    """

    def __init__(
        self, step: int, layout: Layout, theta_g: torch.Tensor, momentum: torch.Tensor, metadata: dict[str, str]
    ):
        if theta_g.numel() != layout.numel or momentum.numel() != layout.momentum_numel:
            raise ValueError("buffers do not match the layout")
        header = shared_header(step, layout, metadata)
        self.step = step
        self._head = struct.pack("<Q", len(header)) + header
        self._tensors = [theta_g.detach(), momentum.detach()] if layout.outer_momentum else [theta_g.detach()]
        self.size = len(self._head) + 4 * (layout.numel + layout.momentum_numel)
        self.sha256 = ""  # set by `hash`, before the first joiner is told about it
        self.detached = False
        self._lock = threading.Lock()  # a read of the live tensors ends before `detach` lets them change

    def _views(self) -> list[memoryview]:
        return [memoryview(self._head), *(t.contiguous().numpy().data.cast("B") for t in self._tensors)]

    def hash(self) -> str:
        """The file's sha256 (blocking: call from a worker thread while the tensors hold still)."""
        digest = hashlib.sha256()
        for view in self._views():
            digest.update(view)
        self.sha256 = digest.hexdigest()
        return self.sha256

    def detach(self) -> None:
        """Keep serving this step from copies: the live tensors are about to change."""
        with self._lock:
            if not self.detached:
                self._tensors = [t.clone() for t in self._tensors]
                self.detached = True

    def pieces(self) -> Iterator[bytes]:
        """The file's bytes in slices of WRITE_SLICE (a file write from the live tensors: `detach`
        waits for the slice being read, and the rest comes from the copies)."""
        for offset in range(0, self.size, WRITE_SLICE):
            yield self.read(offset, WRITE_SLICE)

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes of the file from `offset` (clipped to its end)."""
        out = bytearray()
        with self._lock:
            for view in self._views():
                if offset < len(view) and length > 0:
                    piece = view[max(offset, 0) : max(offset, 0) + length]
                    out += piece
                    length -= len(piece)
                offset -= len(view)
        return bytes(out)

    @property
    def info(self) -> CheckpointInfo:
        return CheckpointInfo(self.step, Path(f"<memory:{self.step}>"), self.sha256, self.size)
