"""Checkpoints: one safetensors file per outer step, written atomically, read defensively.

A checkpoint is two files. `ckpt-N` holds what the swarm shares: θ_g (one tensor per
parameter), the outer momentum and metadata (run id, outer step, model description and
hash, dtnode version); members of a group leave a round with identical θ_g and momentum,
so their `ckpt-N` files are byte-identical and a joiner can fetch ranges of one file from
several of them. `local-N` holds what is this node's own: the inner AdamW moments (flat, in
parameter order), the data stream's generator state and the inner step counts; only a
restart of the same node reads it (a joiner starts its own inner state fresh, with warmup).
`local-N` is written first and `ckpt-N` last, so a whole `ckpt-N` means the step is whole. It is
written by streaming the flat buffers straight into the file while hashing them (no second
copy of the model in memory; on a CPU node θ_g and the momentum are read in place, see
checkpoints/store.py), to a temp file that is fsynced and renamed, so a kill -9 at any moment leaves the
previous checkpoint whole. Reading never unpickles: safetensors only, and every name, shape,
dtype and value is checked against this node's model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import struct
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from dtnode import __version__
from dtnode.daemon.checkpoints.arrivals import Download
from dtnode.daemon.config.training_options import InnerOptimizerKind
from dtnode.peers.durable import write_durably

MAX_STEP = 1 << 62  # the largest outer step a checkpoint, a record or a request may name

log = logging.getLogger(__name__)

FORMAT = "dtnode-checkpoint-v2"
INNER = ("inner/exp_avg", "inner/exp_avg_sq")
INNER_OPTIMIZERS = tuple(kind.value for kind in InnerOptimizerKind)
GENERATOR = "data/generator_state"
FEEDBACK = "outer/error_feedback"  # what the wire code has not sent yet (sparse; int8 with --error-feedback)
GENERATOR_LIMIT = 1 << 16  # bytes; a CPU torch.Generator state is about 5 kB
_NAME = re.compile(r"^ckpt-(\d{8,})\.safetensors$")
LOCAL_FORMAT = "dtnode-local-state-v1"
HEADER_LIMIT = 16 << 20  # bytes of JSON header we are willing to parse
# This process's mark on its temp files: its pid (not unique in containers, where every run is
# PID 1) and a random tag. A temp file with another mark is a dead writer's once it is older
# than STALE_TEMP_S (or its pid is gone): one node holds a state dir at a time.
RUN_TOKEN = f"{os.getpid()}-{secrets.token_hex(4)}"
STALE_TEMP_S = 60.0


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
    """Names and shapes of the parameters, in flat-buffer order, and whether the file holds the
    outer momentum (not for a swarm without it, plain SGD: sparse's default)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    outer_momentum: bool = True

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def momentum_numel(self) -> int:
        """Values of the momentum in the file, and in a TrainingState (0: none, an empty tensor)."""
        return self.numel if self.outer_momentum else 0

    def file_size_bound(self) -> int:
        """No honest checkpoint of this model is larger than this."""
        return 2 * 4 * self.numel + HEADER_LIMIT + 8


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:08d}.safetensors"


def local_state_path(directory: Path, step: int) -> Path:
    return directory / f"local-{step:08d}.safetensors"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in the directory, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


@dataclass
class LocalState:
    """This node's own place in training: inner optimizer moments and data position (CPU)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    generator_state: torch.Tensor  # uint8
    inner_step: int
    adam_steps: int
    batches_drawn: int  # of the batch size it was written with (files before sequences_drawn)
    sequences_drawn: int | None = None  # the data position; None in a file that predates it
    error_feedback: torch.Tensor | None = None  # owed to the swarm: not sent yet, not in θ_g
    # which optimizer the moments are of (--inner-optimizer): Muon's hold no second moment, which
    # AdamW would divide by; a file that predates the field is AdamW's
    inner_optimizer: str = "adamw"


class SharedBytes(Protocol):
    """The bytes of a `ckpt-N` file, in order (in_memory.MemoryCheckpoint)."""

    def pieces(self) -> Iterator[bytes | memoryview]: ...


@dataclass
class TrainingState:
    theta_g: torch.Tensor
    momentum: torch.Tensor  # empty without outer momentum (Layout.outer_momentum)
    local: LocalState | None = None
    # `ckpt-N`'s bytes read from θ_g and the momentum in place (on a CPU), which are then the live
    # tensors: no model-sized copy for the write, one only if they change while it lasts
    live: SharedBytes | None = None


def _entries(tensors: list[tuple[str, str, list[int], int]], metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def tensor_pieces(header: bytes, buffers: list[torch.Tensor]) -> list[bytes | memoryview]:
    """A safetensors file's bytes: the header's length, the header, then the tensors' bytes in place."""
    pieces: list[bytes | memoryview] = [struct.pack("<Q", len(header)), header]
    return pieces + [t.detach().cpu().contiguous().numpy().data.cast("B") for t in buffers]


def _write_atomic(final: Path, pieces: Iterable[bytes | memoryview]) -> tuple[str, int]:
    """A whole file or none (peers/durable.py), its temp file named for this run (a restart
    removes what a killed run left: `RUN_TOKEN`); returns (sha256, size)."""
    return write_durably(final, pieces, final.parent / f".{final.name}.tmp-{RUN_TOKEN}")


def write_checkpoint(
    directory: Path, step: int, layout: Layout, state: TrainingState, metadata: dict[str, str]
) -> CheckpointInfo:
    """Atomically and durably write one checkpoint, local state first (blocking: call from a
    worker thread). Written on demand for a joiner too: a file this node serves and may resume
    from is never one a power loss could leave torn under its final name."""
    if state.theta_g.numel() != layout.numel or state.momentum.numel() != layout.momentum_numel:
        raise ValueError("buffers do not match the layout")
    directory.mkdir(parents=True, exist_ok=True)
    if state.local is not None:
        local = state.local
        if local.exp_avg.numel() != layout.numel or local.exp_avg_sq.numel() != layout.numel:
            raise ValueError("inner optimizer state does not match the layout")
        generator = local.generator_state.to(torch.uint8).contiguous()
        if generator.numel() > GENERATOR_LIMIT:
            raise ValueError("generator state is implausibly large")
        local_meta = {
            "format": LOCAL_FORMAT,
            "run_id": metadata.get("run_id", ""),
            "model_hash": metadata.get("model_hash", ""),
            "outer_step": str(step),
            "inner_step": str(local.inner_step),
            "adam_steps": str(local.adam_steps),
            "data_batches_drawn": str(local.batches_drawn),
            "inner_optimizer": local.inner_optimizer,
        }
        if local.sequences_drawn is not None:
            local_meta["data_sequences_drawn"] = str(local.sequences_drawn)
        n = 4 * layout.numel
        entries = [
            (INNER[0], "F32", [layout.numel], n),
            (INNER[1], "F32", [layout.numel], n),
            (GENERATOR, "U8", [generator.numel()], generator.numel()),
        ]
        buffers = [local.exp_avg, local.exp_avg_sq, generator]
        if local.error_feedback is not None:
            if local.error_feedback.numel() != layout.numel:
                raise ValueError("error-feedback buffer does not match the layout")
            entries.append((FEEDBACK, "F32", [layout.numel], n))
            buffers.append(local.error_feedback)
        _write_atomic(local_state_path(directory, step), tensor_pieces(_entries(entries, local_meta), buffers))
    final = checkpoint_path(directory, step)
    if state.live is not None:
        pieces: Iterable[bytes | memoryview] = state.live.pieces()
    else:
        buffers = [state.theta_g, state.momentum] if layout.outer_momentum else [state.theta_g]
        pieces = tensor_pieces(shared_header(step, layout, metadata), buffers)
    sha256, size = _write_atomic(final, pieces)
    return CheckpointInfo(step, final, sha256, size)


def shared_header(step: int, layout: Layout, metadata: dict[str, str]) -> bytes:
    """The JSON header of `ckpt-N` (θ_g per parameter, then the momentum if the swarm has one)."""
    meta = {"format": FORMAT, "outer_step": str(step), "dtnode_version": __version__, **metadata}
    tensors = [
        (f"theta_g/{name}", "F32", list(shape), 4 * math.prod(shape))
        for name, shape in zip(layout.names, layout.shapes)
    ]
    if layout.outer_momentum:
        tensors.append(("outer_momentum", "F32", [layout.numel], 4 * layout.numel))
    return _entries(tensors, meta)


ABANDONED_DIR = "abandoned"


def set_aside_checkpoints_after(directory: Path, step: int) -> list[int]:
    """Move the checkpoints newer than `step` (a branch the swarm did not follow) into
    `abandoned/`, replacing what an earlier branch left there: never resumed from or served,
    kept for whoever wants to look. Returns the steps moved."""
    later = [(s, path) for s, path in list_checkpoints(directory) if s > step]
    if not later:
        return []
    aside = directory / ABANDONED_DIR
    if aside.exists():
        shutil.rmtree(aside)
    aside.mkdir()
    for s, path in later:
        path.rename(aside / path.name)
        local = local_state_path(directory, s)
        if local.exists():
            local.rename(aside / local.name)
    return sorted(s for s, _ in later)


def prune_checkpoints(directory: Path, keep: int, protect: Collection[int] = ()) -> set[int]:
    """Delete all but the newest `keep` checkpoints (and those in `protect`: being served to
    a joiner, whose later ranges still need the file) and torn temp files; return the kept steps."""
    found = list_checkpoints(directory)
    for step, path in found[keep:]:
        if step in protect:
            continue
        path.unlink(missing_ok=True)
        local_state_path(directory, step).unlink(missing_ok=True)
    kept = {step for step, _ in found[:keep]} | {step for step, _ in found if step in protect}
    for local in directory.glob("local-*.safetensors"):  # orphans of steps whose ckpt never landed
        digits = local.name[6:-12]
        if digits.isdigit() and int(digits) not in kept and (not found or int(digits) < found[0][0]):
            local.unlink(missing_ok=True)
    for stale in list(directory.glob(".ckpt-*.tmp-*")) + list(directory.glob(".local-*.tmp-*")):
        if stale_temp_file(stale):
            stale.unlink(missing_ok=True)
    return kept


def stale_temp_file(path: Path, now: float | None = None) -> bool:
    """A temp file left by a writer that died: not this process's, and old or of a dead pid."""
    mark = path.name.rsplit(".tmp-", 1)[-1]
    if mark == RUN_TOKEN:
        return False
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except OSError:
        return False
    return age > STALE_TEMP_S or not _pid_alive(mark.split("-", 1)[0])


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
    state: TrainingState
    metadata: dict[str, str]
    file: CheckpointInfo | None = None  # where it now lies in the state dir, when it was kept there
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage of a download, for the log
    download: Download | None = None  # a peer's file: from how many donors, and its size

    @property
    def theta_g(self) -> torch.Tensor:
        return self.state.theta_g

    @property
    def momentum(self) -> torch.Tensor:
        return self.state.momentum


def _open_checked(path: Path, bound: int):
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"cannot read {path.name}: {e}") from None
    if size > bound:
        raise CheckpointError(f"{path.name} is {size} bytes, more than this model's checkpoint can be")
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or struct.unpack("<Q", head)[0] > min(HEADER_LIMIT, size - 8):
        raise CheckpointError(f"{path.name} has a torn or oversized header")
    return safe_open(str(path), framework="pt")


def read_metadata(path: Path) -> dict[str, str]:
    """A checkpoint's metadata header alone (to learn its model before checking its tensors)."""
    try:
        with _open_checked(path, path.stat().st_size) as f:
            meta = f.metadata() or {}
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001  (safetensors raises its own errors for malformed files)
        raise CheckpointError(f"{path.name} is not a valid safetensors file: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path.name} is not a dtnode checkpoint (format {meta.get('format')!r})")
    return meta


def read_checkpoint(path: Path, layout: Layout, run_id: str, model_hash: str) -> LoadedCheckpoint:
    """Load and validate a checkpoint from any source (our own disk or a peer's download)."""
    try:
        with _open_checked(path, layout.file_size_bound()) as f:
            meta = f.metadata() or {}
            # the momentum is optional either way: a swarm without it reads an older file of
            # zeros (and ignores them), one with it starts from zero on a file without
            theta_names, names = {f"theta_g/{n}" for n in layout.names}, set(f.keys())
            if names - {"outer_momentum"} != theta_names:
                raise CheckpointError(f"{path.name}: tensor names differ from this model's")
            _check_metadata(path, meta, run_id, model_hash, FORMAT)
            theta = torch.empty(layout.numel, dtype=torch.float32)
            offset = 0
            for name, shape in zip(layout.names, layout.shapes):
                tensor = _checked(f, f"theta_g/{name}", shape)
                theta[offset : offset + tensor.numel()] = tensor.reshape(-1)
                offset += tensor.numel()
            momentum = torch.empty(0)
            if layout.outer_momentum and "outer_momentum" in names:
                momentum = _checked(f, "outer_momentum", (layout.numel,))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001  (safetensors raises its own errors for malformed files)
        raise CheckpointError(f"{path.name} is not a valid safetensors file: {e}") from None
    return LoadedCheckpoint(int(meta["outer_step"]), TrainingState(theta, momentum), meta)


def read_local_state(directory: Path, step: int, layout: Layout, run_id: str, model_hash: str) -> LocalState:
    """This node's own inner state saved with checkpoint `step` (raises CheckpointError)."""
    path = local_state_path(directory, step)
    try:
        with _open_checked(path, 3 * 4 * layout.numel + GENERATOR_LIMIT + HEADER_LIMIT + 8) as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if names - {FEEDBACK} != {*INNER, GENERATOR}:
                raise CheckpointError(f"{path.name}: tensor names differ from a local state's")
            feedback = _checked(f, FEEDBACK, (layout.numel,)) if FEEDBACK in names else None
            _check_metadata(path, meta, run_id, model_hash, LOCAL_FORMAT)
            if meta["outer_step"] != str(step):
                raise CheckpointError(f"{path.name} names outer step {meta['outer_step']}")
            exp_avg, exp_avg_sq = (_checked(f, key, (layout.numel,)) for key in INNER)
            if bool((exp_avg_sq < 0).any()):
                raise CheckpointError(f"{path.name}: negative second moments")
            generator = f.get_slice(GENERATOR)
            if (
                generator.get_dtype() != "U8"
                or len(generator.get_shape()) != 1
                or generator.get_shape()[0] > GENERATOR_LIMIT
            ):
                raise CheckpointError(f"{path.name}: malformed generator state")
            generator_state = f.get_tensor(GENERATOR)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001  (safetensors raises its own errors for malformed files)
        raise CheckpointError(f"{path.name} is not a valid safetensors file: {e}") from None
    counts = []
    for key in ("inner_step", "adam_steps", "data_batches_drawn"):
        raw = str(meta.get(key, ""))
        if not raw.isdigit() or len(raw) > 18:
            raise CheckpointError(f"{path.name}: {key} is not a non-negative integer")
        counts.append(int(raw))
    sequences = str(meta.get("data_sequences_drawn", ""))
    if sequences and (not sequences.isdigit() or len(sequences) > 18):
        raise CheckpointError(f"{path.name}: data_sequences_drawn is not a non-negative integer")
    inner_step, adam_steps, batches = counts
    kind = str(meta.get("inner_optimizer", "adamw"))
    if kind not in INNER_OPTIMIZERS:
        raise CheckpointError(f"{path.name}: inner_optimizer {kind[:40]!r} is none of {', '.join(INNER_OPTIMIZERS)}")
    return LocalState(
        exp_avg,
        exp_avg_sq,
        generator_state,
        inner_step,
        adam_steps,
        batches,
        int(sequences) if sequences else None,
        feedback,
        kind,
    )


def _check_metadata(path: Path, meta: dict[str, str], run_id: str, model_hash: str, fmt: str) -> None:
    if meta.get("format") != fmt:
        raise CheckpointError(f"{path.name}: unknown format {meta.get('format')!r}")
    if meta.get("run_id") != run_id:
        raise CheckpointError(f"{path.name} belongs to run {meta.get('run_id')!r}, not {run_id!r}")
    if meta.get("model_hash") != model_hash:
        raise CheckpointError(f"{path.name} is for another model configuration ({meta.get('model_hash')})")
    if not str(meta.get("outer_step", "")).isdigit() or len(str(meta.get("outer_step"))) > 18:
        raise CheckpointError(f"{path.name}: outer_step is not a non-negative integer")


def _checked(f, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    piece = f.get_slice(key)
    if piece.get_dtype() != "F32" or tuple(piece.get_shape()) != tuple(shape):
        raise CheckpointError(f"{key}: expected F32{list(shape)}, got {piece.get_dtype()}{piece.get_shape()}")
    tensor = f.get_tensor(key)
    if not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"{key} holds non-finite values")
    return tensor
