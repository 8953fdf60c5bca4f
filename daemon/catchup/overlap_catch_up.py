"""--overlap, the first round after a download or a start from this node's own checkpoint: the
swarm's θ_g of the round's next step, fetched while the round trains and taken at its end
instead of an outer step of this node's own.

Such a node entered round r from θ_g of step r-1, as the swarm did, but took no part in the
average of round r-1 that the swarm applies now (the delayed outer step). So it takes the
swarm's θ_g of step r and sends this round's Δ out with theirs. That θ_g is fetched from the
moment a peer holds it: fetched only at the round's end, its download and checks came after
the peers had formed their group, and the joiner's first Δ went out alone (CI saw it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import torch

from dtnode.daemon.checkpoints.arrivals import ThetaSource
from dtnode.daemon.checkpoints.file_format import LoadedCheckpoint
from dtnode.daemon.checkpoints.store import CheckpointStore
from dtnode.daemon.stopping import pause
from dtnode.daemon.training.worker import ModelWorker
from dtnode.ops.coded import CodedDelta
from dtnode.peers.membership import Membership, PeerRecord

log = logging.getLogger("dtnode")

OPEN_POLL_S = (
    0.2  # how often a node waiting on the swarm (its round to open, a peer to hold a step) re-reads the records
)

Fetch = Callable[[dict[str, PeerRecord], range], Awaitable[LoadedCheckpoint | None]]


class OverlapCatchUp:
    """The catch-up round's θ_g of the next step: fetched while the round trains, then taken."""

    def __init__(
        self,
        peer_id: str,
        model_hash: str,
        membership: Membership,
        worker: ModelWorker,
        store: CheckpointStore,
        stopping: asyncio.Event,
        bound_s: float,
        fetch: Fetch,
    ):
        self.peer_id = peer_id
        self.model_hash = model_hash
        self.membership = membership
        self.worker = worker
        self.store = store
        self.stopping = stopping
        self.bound_s = bound_s  # how long the round's end waits for the fetch (--averaging's bound)
        self.fetch = fetch  # the swarm's checkpoint of a step, verified and kept (`Joiner`'s fetch)
        self._prefetch: tuple[int, asyncio.Task[LoadedCheckpoint | None]] | None = None

    def start(self, round_no: int) -> None:
        """Fetch θ_g of step `round_no` from the moment a live peer holds it."""
        if self._prefetch is not None:
            self._prefetch[1].cancel()
        task = asyncio.create_task(self._fetch_once_served(round_no))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a stop may leave it unread
        self._prefetch = (round_no, task)

    def drop(self) -> None:
        """No θ_g to take (the round ended with an average of its own, or a download replaces it)."""
        if self._prefetch is not None:
            self._prefetch[1].cancel()
            self._prefetch = None

    async def take(self, round_no: int) -> torch.Tensor | CodedDelta | None:
        """The swarm's θ_g of step `round_no` adopted (its Δ against this node's θ_l returned to
        go out with the swarm's), or None when no peer could serve it within the bound: the
        round then goes on as after a failed average."""
        if self._prefetch is None or self._prefetch[0] != round_no:
            self.start(round_no)
        assert self._prefetch is not None
        task = self._prefetch[1]
        self._prefetch = None
        done, _ = await asyncio.wait({task}, timeout=self.bound_s)
        loaded = task.result() if done else None
        if not done:
            task.cancel()
        if loaded is None:
            log.warning(
                "no peer served θ_g of step %d in time; round %d goes on as after a failed average", round_no, round_no
            )
            return None
        await self.store.keep_downloaded(loaded, ThetaSource.TAKEN)
        delta = await self.worker.call(self.worker.adopt_downloaded, loaded)
        log.info(
            "took the swarm's θ_g of step %d for round %d (entered without its average of round %d)",
            loaded.step,
            round_no,
            round_no - 1,
        )
        return delta

    async def _fetch_once_served(self, step: int) -> LoadedCheckpoint | None:
        """The swarm's θ_g of `step`, as soon as a live peer's record says it holds it."""
        while not self.stopping.is_set():
            view = await self.membership.members()
            if any(
                r.outer_step >= step and r.model_hash == self.model_hash
                for r in view.values()
                if r.peer_id != self.peer_id and r.state in ("training", "averaging")
            ):
                return await self.fetch(view, range(step, step + 1))
            await pause(self.stopping, OPEN_POLL_S)
        return None
