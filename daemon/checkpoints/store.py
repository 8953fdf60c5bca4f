"""This node's checkpoints behind one class: writing (cadence, on demand, on stop), pruning,
resuming, the files a download brought, and what the sidecar serves.

A checkpoint of the current step is served from θ_g in memory when it can be (see
`MemoryCheckpoint`): after each outer step the store hashes θ_g (the params hash peers
compare) and then the step's file as it would be written, off the training thread, so a
joiner's request is answered at once. θ_g changes only under the worker's lock, which tells
the store first: a memory checkpoint a joiner is still reading goes on from copies.

Writes run on the I/O thread, one at a time; the training thread only takes the snapshot
(and none for an on-demand write, which copies θ_g under the lock). A failed write is logged
and costs that checkpoint, never the node.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from tenacity import AsyncRetrying, retry_if_result, stop_after_attempt

from dtnode.daemon.checkpoints.arrivals import Arrivals, ThetaArrival, ThetaSource
from dtnode.daemon.checkpoints.file_format import (
    ABANDONED_DIR,
    CheckpointError,
    CheckpointInfo,
    LoadedCheckpoint,
    TrainingState,
    file_sha256,
    list_checkpoints,
    prune_checkpoints,
    read_checkpoint,
    read_local_state,
    set_aside_checkpoints_after,
    write_checkpoint,
)
from dtnode.daemon.checkpoints.in_memory import MemoryCheckpoint
from dtnode.daemon.checkpoints.served import RecentlyServed
from dtnode.daemon.telemetry.metrics import NodeMetrics
from dtnode.daemon.training.worker import ModelWorker
from dtnode.ops.flat import sha256_of
from dtnode.peers import failpoints

log = logging.getLogger("dtnode")

HASH_WAIT_S = 30.0  # how long a joiner's request waits for the hash of the step it asks for
ON_DEMAND_WRITE_S = 60.0  # how long a joiner's request waits for a checkpoint written for it
ON_DEMAND_ATTEMPTS = 2  # a write already under way may be of an older step: then one more


class CheckpointStore:
    def __init__(
        self,
        state_dir: Path,
        worker: ModelWorker,
        metadata: dict[str, str],
        keep: int,
        metrics: NodeMetrics,
        steps_in_use: Callable[[], set[int]],
    ):
        self.state_dir = state_dir
        self.worker = worker
        self.layout = worker.layout
        self.metadata = metadata
        self.keep = keep
        self.metrics = metrics
        self.steps_in_use = steps_in_use  # steps a joiner is downloading (the sidecar knows)
        self.io_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self.files: dict[int, CheckpointInfo] = {}
        self.memory: dict[int, MemoryCheckpoint] = {}
        self._pending_write: asyncio.Future | None = None
        self._served = RecentlyServed()
        self._hash_task: asyncio.Future | None = None
        # files being written from the live θ_g (I/O thread); weak: a write abandoned anywhere lets go
        self._writing: weakref.WeakSet[MemoryCheckpoint] = weakref.WeakSet()
        self.arrivals = Arrivals()  # θ_g's not of this node's own outer step, for the next round's record
        worker.on_theta_change = self._theta_changing

    async def _io(self, fn: Callable, *args: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(self.io_thread, partial(fn, *args))

    # ---- what the sidecar serves -------------------------------------------------------------
    def newest(self) -> CheckpointInfo | None:
        return self.files[max(self.files)] if self.files else None

    def announced(self) -> CheckpointInfo | None:
        """The newest checkpoint this node serves whose hash is known: a file, or this step's copy
        in memory. The record signs its step and sha256, which is what a joiner's vote binds."""
        served = [self.newest(), *(m.info for m in self.memory.values() if m.sha256)]
        return max((c for c in served if c is not None), key=lambda c: c.step, default=None)

    def recently_served(self) -> list[tuple[int, str]]:
        """(step, sha256) of the newest checkpoints this node served or serves, each once
        (served.py): the record signs them all."""
        for info in (self.newest(), *(m.info for m in self.memory.values() if m.sha256)):
            if info is not None and (info.step, info.sha256) not in self._served:
                self._served.add(info.step, info.sha256)
        return self._served.pairs()

    def get(self, step: int) -> CheckpointInfo | None:
        return self.files.get(step)

    def memory_checkpoint(self, step: int) -> MemoryCheckpoint | None:
        memory = self.memory.get(step)
        return memory if memory is not None and memory.sha256 else None

    async def current(self, serving: bool) -> CheckpointInfo | None:
        """The checkpoint of the current outer step, written now if the cadence skipped it.

        A peer catching up needs the swarm's current θ_g, not the last one the cadence kept;
        θ_g and the momentum do not change during inner steps, so they are copied (under the
        lock the outer step takes) without waiting for the training thread. `serving`: the
        node trains or averages (not while it downloads or stops)."""
        newest = self.newest()
        step = self.worker.outer_step
        if step == 0 or (newest is not None and newest.step >= step) or not serving:
            return newest
        if self._hash_task is not None and not self._hash_task.done():  # the step's hash is under way
            await asyncio.wait({asyncio.shield(self._hash_task)}, timeout=HASH_WAIT_S)
        if (memory := self.memory_checkpoint(step)) is not None:
            return memory.info

        def behind(info: CheckpointInfo | None) -> bool:
            return info is None or info.step < step

        retrying = AsyncRetrying(
            stop=stop_after_attempt(ON_DEMAND_ATTEMPTS),
            retry=retry_if_result(behind),
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        return await retrying(self._write_on_demand)

    async def _write_on_demand(self) -> CheckpointInfo | None:
        if self._pending_write is None or self._pending_write.done():
            self._pending_write = asyncio.ensure_future(self.write(local=False))
        await asyncio.wait_for(asyncio.shield(self._pending_write), ON_DEMAND_WRITE_S)
        return self.newest()

    # ---- writing ---------------------------------------------------------------------------
    async def schedule(self) -> None:
        """Write this step's checkpoint in the background (one write at a time).

        The snapshot is taken before this returns, between rounds: queued behind the next
        round's inner steps it would hold their inner state, and under --overlap the step of
        an average that landed during them, so the scheduled step would never be written."""
        await self.settle_write()
        step, state = await self._snapshot(local=True)
        self._pending_write = asyncio.ensure_future(self._write_snapshot(step, state, local=True))

    async def settle_write(self) -> None:
        """The write under way, if any, once done (its failure is logged by `_write_snapshot`)."""
        if self._pending_write is not None:
            await asyncio.gather(self._pending_write, return_exceptions=True)

    async def write(self, local: bool = True) -> None:
        """Snapshot (the only work on the training thread, or none without `local`), write on
        the I/O thread. On a CPU, θ_g and the momentum are written from the live tensors (see
        `_live`), not from copies: 8 bytes per parameter less while the file is written."""
        step, state = await self._snapshot(local)
        await self._write_snapshot(step, state, local)

    async def _snapshot(self, local: bool) -> tuple[int, TrainingState]:
        return await asyncio.get_running_loop().run_in_executor(
            self.worker.thread if local else self.io_thread, self.worker.snapshot, local, self._live
        )

    async def _write_snapshot(self, step: int, state: TrainingState, local: bool) -> None:
        loop = asyncio.get_running_loop()
        if failpoints.serves_wrong_checkpoint(step):  # a lying donor, for tests (its own θ_g is untouched)
            self._let_go(state)
            state = TrainingState(state.theta_g + 1.0, state.momentum.clone(), state.local)
        try:
            started = time.monotonic()
            info = await loop.run_in_executor(self.io_thread, partial(self._write_file, step, state))
            self.metrics.checkpoint_write_seconds.observe(time.monotonic() - started)
        except OSError as e:  # this node's disk: the step is not kept, the node goes on
            self.metrics.checkpoint_write_failures.inc()
            log.error("could not write checkpoint %d to this node's state dir: %s", step, e)
            return
        self.files[step] = info
        self._served.add(step, info.sha256)
        if not local:  # the operator's counterpart of "serving checkpoint N from memory" (θ_g on a GPU)
            log.info("wrote checkpoint %d on demand, for a peer catching up", step)
        await self.prune()

    def _live(self, step: int, theta_g: torch.Tensor, momentum: torch.Tensor) -> MemoryCheckpoint:
        """The file's bytes read from the live θ_g and momentum (under the worker's lock): held
        in `_writing` until the write is done, so that a change of θ_g meanwhile gives it copies
        first (`_theta_changing`)."""
        live = MemoryCheckpoint(step, self.layout, theta_g, momentum, self.metadata)
        self._writing.add(live)
        return live

    def _write_file(self, step: int, state: TrainingState) -> CheckpointInfo:
        """The I/O thread's part of `write`; whatever happens, the live tensors are let go."""
        try:
            return write_checkpoint(self.state_dir, step, self.layout, state, self.metadata)
        finally:
            self._let_go(state)

    def _let_go(self, state: TrainingState) -> None:
        if isinstance(state.live, MemoryCheckpoint):
            self._writing.discard(state.live)

    async def write_final(self) -> None:
        """On stop: the current step, unless a checkpoint of it exists."""
        await self.settle_write()
        step = self.worker.outer_step if self.worker.built else 0
        if step > 0 and step not in self.files:
            await self.write()

    async def keep_downloaded(self, loaded: LoadedCheckpoint, source: ThetaSource = ThetaSource.DOWNLOADED) -> None:
        """The donors' file is this node's checkpoint of that step: registered, never rewritten;
        `source`: how its θ_g came in (installed whole, or taken at a round's end)."""
        self.arrivals.note(ThetaArrival(source, loaded.step, loaded.download))
        self.metrics.catchups.inc()
        if loaded.file is not None:
            self.metrics.checkpoint_downloaded.inc(loaded.file.size_bytes)
            self.files[loaded.step] = loaded.file
            await self.prune()

    async def set_aside_after(self, step: int) -> None:
        """This node's checkpoints newer than `step` (a branch the swarm did not follow)."""
        moved = await self._io(set_aside_checkpoints_after, self.state_dir, step)
        self.files = {s: i for s, i in self.files.items() if s <= step}
        log.info("moved this node's checkpoints of steps %s to %s", moved, self.state_dir / ABANDONED_DIR)

    async def prune(self) -> None:
        """Keep the newest --keep-checkpoints, and any a joiner is still downloading."""
        kept = await self._io(prune_checkpoints, self.state_dir, self.keep, self.steps_in_use())
        assert isinstance(kept, set)
        self.files = {s: i for s, i in self.files.items() if s in kept}
        self._show_newest()

    def _show_newest(self) -> None:
        self.metrics.checkpoint_newest_step.set(max(self.files, default=-1))

    # ---- resuming --------------------------------------------------------------------------
    def resume(self, run_id: str, model_hash: str) -> None:
        """Resume from the newest whole checkpoint in the state dir, skipping torn ones
        (blocking: the I/O thread, before the first round)."""
        replica = self.worker.replica
        for step, path in list_checkpoints(self.state_dir):
            try:
                loaded = read_checkpoint(path, self.layout, run_id, model_hash)
            except CheckpointError as e:
                log.warning("skipping checkpoint %s: %s", path.name, e)
                continue
            try:
                local = read_local_state(self.state_dir, step, self.layout, run_id, model_hash)
            except CheckpointError as e:
                log.warning("no usable inner state for step %d (%s): inner optimizer starts fresh", step, e)
                local = None
            self.worker.install(loaded, local)
            replica.set_params_sha256(sha256_of(replica.host_theta()))
            self.files[step] = CheckpointInfo(step, path, file_sha256(path), path.stat().st_size)
            self._show_newest()
            self.arrivals.note(ThetaArrival(ThetaSource.RESUMED, step, params_sha256=replica.params_sha256()))
            log.info("resumed from %s (outer step %d, params %s)", path.name, step, replica.params_sha256()[:12])
            return

    # ---- θ_g's hash, and the step served from memory -------------------------------------------
    def rehash(self, host: torch.Tensor | None = None) -> None:
        """Start hashing the new θ_g (`host`: already copied to the host by a landing)."""
        self._hash_task = asyncio.ensure_future(self._rehash(host))

    async def settle_hash(self) -> None:
        """The hash under way, once done: before θ_g changes again (the hash reads it)."""
        task = self._hash_task
        if task is None:
            return
        await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled() and (e := task.exception()) is not None:
            log.error(
                "hashing θ_g failed (%s: %s); the record shows no params hash until the next step",
                type(e).__name__,
                e,
                exc_info=e,
            )

    def when_hashed(self, callback: Callable[[], None]) -> None:
        """Run `callback` once θ_g's hash is in (at once if it is)."""
        task = self._hash_task
        if task is None or task.done():
            callback()
        else:
            task.add_done_callback(lambda _: callback())

    async def _rehash(self, host: torch.Tensor | None) -> None:
        """params_sha256 of the new θ_g: one device-to-host copy on the training thread, the
        hash on the I/O thread (θ_g does not change before the next outer step awaits this);
        then this step's checkpoint, ready to be served from memory. A joiner asking for the
        step waits for this, so it runs beside the eval, not after it."""
        replica = self.worker.replica
        if host is None:  # else copied already, by a landing between inner steps
            # nothing to copy on a CPU: no wait behind the training thread's eval
            host = replica.host_theta() if replica.theta_on_host else await self.worker.call(replica.host_theta)
        digest = await self._io(sha256_of, host)
        assert isinstance(digest, str)
        replica.set_params_sha256(digest)
        await self._prepare_memory_checkpoint()

    async def _prepare_memory_checkpoint(self) -> None:
        """Hash θ_g and the momentum as this step's file would hold them, so that a joiner's
        request is answered at once from the live tensors instead of waiting for the file to
        be written. CPU state only: on a GPU the checkpoint is written on demand, as a device
        copy would be made anyway."""
        replica = self.worker.replica
        step, version = replica.outer_step, self.worker.theta_version
        if (
            step == 0
            or step in self.files
            or step in self.memory
            or replica.theta_g.device.type != "cpu"
            or replica.outer.momentum_buffer.device.type != "cpu"
            or failpoints.serves_wrong_checkpoint(step)
        ):
            return
        memory = MemoryCheckpoint(step, self.layout, replica.theta_g, replica.outer.momentum_buffer, self.metadata)
        await self._io(memory.hash)
        if self.worker.theta_version != version:
            return  # θ_g changed while it was hashed: the hash is of neither
        in_use = self.steps_in_use()
        for old in [s for s in self.memory if s not in in_use]:
            del self.memory[old]
        self.memory[step] = memory
        self._served.add(step, memory.sha256)

    def _theta_changing(self) -> None:
        """θ_g is about to change (under the worker's lock): a step a joiner asked for lately
        goes on from copies, the others are dropped."""
        for live in list(self._writing):  # a file still being written from them
            live.detach()
        in_use = self.steps_in_use()
        for step, memory in list(self.memory.items()):
            if step in in_use:
                memory.detach()
            else:
                self.memory.pop(step, None)

    def shutdown(self) -> None:
        self.io_thread.shutdown(wait=True)
