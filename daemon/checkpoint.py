"""Checkpoints: one safetensors file per outer step, written atomically, read defensively.

A checkpoint holds θ_g (one tensor per parameter), the outer momentum, and metadata (run id,
outer step, model description and hash, dtnode version) in the safetensors header. It is
written by streaming the flat buffers straight into the file while hashing them (no second
copy of the model in memory), to a temp file that is fsynced and renamed, so a kill -9 at
any moment leaves the previous checkpoint whole. Reading never unpickles: safetensors only,
and every name, shape, dtype and value is checked against this node's model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dtnode import __version__

log = logging.getLogger(__name__)

FORMAT = "dtnode-checkpoint-v1"
_NAME = re.compile(r"^ckpt-(\d{8,})\.safetensors$")
HEADER_LIMIT = 16 << 20  # bytes of JSON header we are willing to parse


class CheckpointError(ValueError):
    """A checkpoint that is torn, corrupt, foreign or does not fit this model."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class Layout:
    """Names and shapes of the parameters, in flat-buffer order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(_prod(s) for s in self.shapes)

    def file_size_bound(self) -> int:
        """No honest checkpoint of this model is larger than this."""
        return 2 * 4 * self.numel + HEADER_LIMIT + 8


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:08d}.safetensors"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in the directory, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def _header(layout: Layout, metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, shape in zip(layout.names, layout.shapes):
        size = 4 * _prod(shape)
        entries[f"theta_g/{name}"] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    entries["outer_momentum"] = {"dtype": "F32", "shape": [layout.numel], "data_offsets": [offset, offset + 4 * layout.numel]}
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_checkpoint(directory: Path, step: int, layout: Layout, theta_g: torch.Tensor, momentum: torch.Tensor,
                     metadata: dict[str, str]) -> CheckpointInfo:
    """Atomically write one checkpoint (blocking: call from a worker thread)."""
    if theta_g.numel() != layout.numel or momentum.numel() != layout.numel:
        raise ValueError("buffers do not match the layout")
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "outer_step": str(step), "dtnode_version": __version__, **metadata}
    header = _header(layout, meta)
    final = checkpoint_path(directory, step)
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    digest = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as f:
            for piece in (struct.pack("<Q", len(header)), header,
                          memoryview(theta_g.detach().cpu().contiguous().numpy()).cast("B"),
                          memoryview(momentum.detach().cpu().contiguous().numpy()).cast("B")):
                f.write(piece)
                digest.update(piece)
                size += len(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return CheckpointInfo(step, final, digest.hexdigest(), size)


def prune_checkpoints(directory: Path, keep: int) -> set[int]:
    """Delete all but the newest `keep` checkpoints and torn temp files; return the kept steps."""
    found = list_checkpoints(directory)
    for _, path in found[keep:]:
        path.unlink(missing_ok=True)
    for stale in directory.glob(".ckpt-*.tmp-*"):  # torn writes of a killed process
        if not _pid_alive(stale.name.rsplit("-", 1)[-1]):
            stale.unlink(missing_ok=True)
    return {step for step, _ in found[:keep]}


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class LoadedCheckpoint:
    step: int
    theta_g: torch.Tensor
    momentum: torch.Tensor
    metadata: dict[str, str]


def read_checkpoint(path: Path, layout: Layout, run_id: str, model_hash: str) -> LoadedCheckpoint:
    """Load and validate a checkpoint from any source (our own disk or a peer's download)."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"cannot read {path.name}: {e}") from None
    if size > layout.file_size_bound():
        raise CheckpointError(f"{path.name} is {size} bytes, more than this model's checkpoint can be")
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or struct.unpack("<Q", head)[0] > min(HEADER_LIMIT, size - 8):
        raise CheckpointError(f"{path.name} has a torn or oversized header")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            expected = {f"theta_g/{n}" for n in layout.names} | {"outer_momentum"}
            if keys != expected:
                raise CheckpointError(f"{path.name}: tensor names differ from this model's")
            _check_metadata(path, meta, run_id, model_hash)
            theta = torch.empty(layout.numel, dtype=torch.float32)
            offset = 0
            for name, shape in zip(layout.names, layout.shapes):
                tensor = _checked(f, f"theta_g/{name}", shape)
                theta[offset : offset + tensor.numel()] = tensor.reshape(-1)
                offset += tensor.numel()
            momentum = _checked(f, "outer_momentum", (layout.numel,))
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own errors for malformed files
        raise CheckpointError(f"{path.name} is not a valid safetensors file: {e}") from None
    return LoadedCheckpoint(int(meta["outer_step"]), theta, momentum, meta)


def _check_metadata(path: Path, meta: dict[str, str], run_id: str, model_hash: str) -> None:
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path.name}: unknown format {meta.get('format')!r}")
    if meta.get("run_id") != run_id:
        raise CheckpointError(f"{path.name} belongs to run {meta.get('run_id')!r}, not {run_id!r}")
    if meta.get("model_hash") != model_hash:
        raise CheckpointError(f"{path.name} is for another model configuration ({meta.get('model_hash')})")
    if not str(meta.get("outer_step", "")).isdigit():
        raise CheckpointError(f"{path.name}: outer_step is not a non-negative integer")


def _checked(f, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    piece = f.get_slice(key)
    if piece.get_dtype() != "F32" or tuple(piece.get_shape()) != tuple(shape):
        raise CheckpointError(f"{key}: expected F32{list(shape)}, got {piece.get_dtype()}{piece.get_shape()}")
    tensor = f.get_tensor(key)
    if not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"{key} holds non-finite values")
    return tensor
