"""--overlap: the average of the last round's Δ, in flight while the next round trains, and
where its outer step lands.

The average runs on the event loop during the next round's inner steps. Once it is in (and
the hash of the θ_g it will change is done), the training thread makes its outer step
between two inner steps (`land_on_arrival`), keeping the progress made since on top
(`Replica.land`); at the round's end one that has not landed yet is waited for and landed
there. A failed average lands as nothing: its Δ goes out again inside the next one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

import torch

from dtnode.daemon.checkpoints.store import CheckpointStore
from dtnode.daemon.telemetry.metrics import NodeMetrics
from dtnode.daemon.training.worker import ModelWorker
from dtnode.ops.coded import CodedDelta
from dtnode.peers import failpoints
from dtnode.peers.averager import AveragingResult, AveragingTimeout

log = logging.getLogger("dtnode")


class Landing:
    def __init__(self, worker: ModelWorker, store: CheckpointStore, metrics: NodeMetrics):
        self.worker = worker
        self.store = store
        self.metrics = metrics
        self._task: asyncio.Future[AveragingResult] | None = None
        self._arrival: AveragingResult | None = None  # set on the event loop once the average is in
        self.landed = True  # whether its outer step was made (by the training thread)
        self.landed_after_steps: int | None = None  # inner steps of this round before it landed
        self.resync_asked = False  # whether the average in flight was asked to re-sync θ_g
        self.waited_s = 0.0  # this round's wait for the average (a phase of the round)

    @property
    def in_flight(self) -> bool:
        return self._task is not None

    def launch(self, averaging: Awaitable[AveragingResult], resync: bool) -> None:
        """This round's Δ goes out to be averaged during the next round's inner steps."""
        self.resync_asked = resync
        self._arrival, self.landed, self.landed_after_steps = None, False, None
        self._task = asyncio.ensure_future(self._arrive(averaging))

    async def _arrive(self, averaging: Awaitable[AveragingResult]) -> AveragingResult:
        result = await averaging
        await self.store.settle_hash()  # the hash reads the θ_g the landing is about to change
        self._arrival = result
        return result

    def land_on_arrival(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the training thread after each inner step: the outer step of the previous
        round's average as soon as it is in, rather than at this round's end."""
        if self.landed or (result := self._arrival) is None:
            return
        self.land(result)
        self.landed_after_steps = self.worker.trainer.round_steps
        host = self.worker.replica.host_theta()  # on this thread: no wait behind the round's steps
        loop.call_soon_threadsafe(self.store.rehash, host)

    def land(self, result: AveragingResult | None) -> None:
        """On the training thread: the outer step of the average in flight (None: it failed).

        It counts as landed once made: one that raises before fails that round, and the round's
        end or the drain makes it then. (A sharded host whose rank died lands θ_g without θ_l,
        which died with the shards: see Replica.land.)"""
        failpoints.reach("landing-error", self.worker.outer_step)
        self.worker.land(result)
        self.landed = True

    def land_and_stage(self, result: AveragingResult | None) -> torch.Tensor | CodedDelta:
        """On the training thread, at a round's end: the outer step of the previous average if
        it did not land during the steps, then this round's Δ staged (returned)."""
        self.worker.end_round_count()
        if not self.landed:
            self.land(result)
        return self.worker.replica.stage_delta()

    def forget(self) -> None:
        """A download replaced the θ_g the average was for: nothing of it lands."""
        self._arrival, self.landed = None, True

    async def settle(self, timeout: float | None = None) -> AveragingResult | None:
        """The average in flight, once done; None when there is none or it failed (whose Δ
        then goes out again inside the next one's). A wait that ends never cancels the
        average itself, only a timeout does."""
        task, self._task = self._task, None
        if task is None:
            return None
        started = time.monotonic()
        await asyncio.wait({task}, timeout=timeout)
        self.waited_s += time.monotonic() - started
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            log.error("averaging round %d did not end in %.0fs; given up", self.worker.outer_step, timeout or 0)
            return None
        if task.cancelled():
            return None
        if (e := task.exception()) is not None:
            log.error(
                "averaging round %d failed (%s: %s); its Δ goes out again with the next round's",
                self.worker.outer_step,
                type(e).__name__,
                e,
                exc_info=None if isinstance(e, AveragingTimeout) else e,
            )
            self.metrics.round_failures.labels(reason=type(e).__name__).inc()
            return None
        return task.result()

    def needs_resync(self, result: AveragingResult | None) -> bool:
        """A failed or partial average, or an asked re-sync that found nobody: θ_g is re-synced
        in the next groups."""
        return result is None or not result.clean or (self.resync_asked and result.theta is None)

    def take_waited(self) -> float:
        waited, self.waited_s = self.waited_s, 0.0
        return waited
