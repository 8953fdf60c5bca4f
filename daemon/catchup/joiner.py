"""Getting into step with the swarm: the driver that carries out the pure plan (`plan_sync`,
catchup/sync_plan.py) and the checks at the door (catchup/admission.py).

A node is in step when it trains the swarm's open round from the θ_g that round starts
from. `plan_sync` decides, from the peers' records and this node's position alone, whether
to train on, wait for the round to open, download, ask again later, or give up for now; it
does no I/O, so every case is a unit test. `Joiner` reads the records, follows the plan and
installs what it downloads. What happens when a download fails: `fetch_from_swarm` (catchup/donors.py)
tries every group of donors and then each donor alone; if none serves, the plan is made
again from fresh records: a round that moved is downloaded at once, one that has not is asked
for again a heartbeat later (its θ_g may not be served yet), and after MAX_SYNC_DOWNLOADS
the node trains on from its own θ_g, asking its next groups to re-sync it.

The open round comes from the records (`swarm_position`): a round whose peers already
average it is closed, so a node arriving then waits for the next round's θ_g instead of
training a round nobody will average with it, and a round that closes during the download
sends it back for the next one. The swarm's round is the upper median over the peers, not
their maximum: one node that raced ahead alone must not pull everyone onto its branch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from functools import partial
from typing import Protocol

import torch

from dtnode.daemon.catchup.admission import (
    RecipeReader,
    check_same_data_plane,
    check_same_model,
    check_same_recipe,
)
from dtnode.daemon.catchup.donors import fetch_from_swarm
from dtnode.daemon.catchup.overlap_catch_up import OPEN_POLL_S, OverlapCatchUp
from dtnode.daemon.catchup.swarm_position import SwarmPosition, swarm_moves_past, swarm_position
from dtnode.daemon.catchup.sync_plan import LocalPosition, SyncAction, SyncPlan, plan_sync
from dtnode.daemon.catchup.trust_radius import judge_split_vote
from dtnode.daemon.checkpoints.arrivals import DroppedRound, FetchMiss, Skip, Skipped
from dtnode.daemon.checkpoints.file_format import LoadedCheckpoint
from dtnode.daemon.checkpoints.store import CheckpointStore
from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.stopping import pause
from dtnode.daemon.training.trainer import InnerResult
from dtnode.daemon.training.worker import ModelWorker
from dtnode.daemon.workload.recipe import check_same_protocol
from dtnode.ops.coded import CodedDelta
from dtnode.peers.auth import SwarmAuth
from dtnode.peers.membership import Membership, PeerRecord
from dtnode.peers.tls import TrustStore

log = logging.getLogger("dtnode")

MAX_REENTRIES = 3  # a joiner's first rounds given up in a row because the swarm averaged them without it
# heartbeats a node waits for peers' records to catch up: a donor's to announce a file served
# on demand, or a joiner whose average found no group for its peers' to show the round closed
BIND_HEARTBEATS = 2.5


class AverageInFlight(Protocol):
    """The overlapped average a download must settle first (rounds/landing.py's `Landing`, an
    interface here so that catching up stays below the round loop)."""

    @property
    def in_flight(self) -> bool: ...

    async def settle(self, timeout: float | None = None) -> object: ...

    def forget(self) -> None: ...


class Joiner:
    """Carries out `plan_sync`: downloads, installs, and the --overlap catch-up."""

    def __init__(
        self,
        settings: NodeSettings,
        peer_id: str,
        model_hash: str,
        membership: Membership,
        worker: ModelWorker,
        store: CheckpointStore,
        landing: AverageInFlight,
        trust: TrustStore | None,
        auth: SwarmAuth | None,
        stopping: asyncio.Event,
        syncing: Callable[[], AbstractContextManager],
        publish: Callable[[], None],
    ):
        self.settings = settings
        self.peer_id = peer_id
        self.model_hash = model_hash
        self.membership = membership
        self.worker = worker
        self.store = store
        for why in Skip:  # present at zero, for rate()
            store.metrics.checkpoint_skips.labels(why=why)
        self.landing = landing
        self.trust = trust
        self.auth = auth
        self.recipes = RecipeReader(auth)  # the swarm's recipe fields, when its hash is not this node's
        self.stopping = stopping
        self.syncing = syncing  # the round loop's state move for the time of a download
        self.publish = publish
        self.catch_up_round: int | None = None  # --overlap: a round entered from a download or a start (see catch_up)
        self.entered_round: int | None = None  # the round entered from a download (its first after it)
        self.reentries = 0  # rounds given up in a row for that reason (bounded: see closed_under_us)
        self.joined_at: float | None = None  # monotonic: when a download put this node in step (for the log)
        self.resync_wanted = False  # a download or a failed catch-up: the next groups re-sync θ_g
        # --overlap: the catch-up round's θ_g of the next step, fetched while the round trains (see catch_up)
        self.overlap = OverlapCatchUp(
            peer_id, model_hash, membership, worker, store, stopping, settings.averaging.bound_s, self._fetch
        )

    def take_resync_wish(self) -> bool:
        wanted, self.resync_wanted = self.resync_wanted, False
        return wanted

    async def _pause(self, seconds: float) -> None:
        await pause(self.stopping, seconds)

    async def sync(self, joining: bool = False) -> bool:
        """Put this node in the swarm's open round, downloading its θ_g when this node's differs
        (behind by more than --max-lag, or at all when `joining`: a node that just started).
        True when a download put it in step. A node that was training keeps its inner AdamW
        state and data position through the download (no warmup restart)."""
        lag = 0 if joining else self.settings.swarm.max_lag
        deadline = time.monotonic() + self.settings.swarm.join_timeout
        synced, downloads, waiting, failed_step = False, 0, False, -1
        # a round's check shares the view the pacer's last poll read (`recent_members`); a joiner,
        # and every read after a wait or a download, reads afresh
        read = self.membership.members if joining else self.membership.recent_members
        while not self.stopping.is_set():
            view = await read()
            read = self.membership.members
            if joining:
                await self._check_swarm(view)
            own = self.worker.outer_step
            plan = plan_sync(
                view,
                LocalPosition(
                    self.peer_id, self.model_hash, own, lag, downloads, failed_step, time.monotonic() > deadline
                ),
            )
            position = plan.position
            if plan.action == SyncAction.NO_SWARM:
                return synced
            assert position is not None
            if plan.action == SyncAction.IN_STEP:
                # from where the swarm is now: the download may have brought a newer step than asked.
                # A node that just started from its own checkpoint is in the same place: in an
                # overlapped round one past its θ_g, without the average the swarm has in flight
                if synced or joining:
                    self.catch_up_round = position.round if position.round == own + 1 else None
                return synced
            if plan.action == SyncAction.WAIT:
                if not waiting:
                    self._say_waiting(position, view)
                    waiting = True
                await self._pause(OPEN_POLL_S)
                continue
            if plan.action == SyncAction.GIVE_UP:
                self._say_giving_up(plan, own, downloads)
                return synced
            if plan.action == SyncAction.RETRY:
                await self._pause(self.settings.swarm.heartbeat_interval)
                failed_step = -1
                continue
            downloads += 1
            _say_downloading(plan.ahead, position, own)
            started = time.monotonic()
            if await self.download(view, position.start_step, own, majority=not joining):
                synced, lag = True, 0  # in step now, unless the round closed meanwhile: the loop checks
                self.joined_at = started
                # --overlap peers train round r from θ_g of step r-1: this node trains round r too
                self.catch_up_round = position.round if position.round == self.worker.outer_step + 1 else None
            else:
                failed_step = position.start_step  # the next plan says whether to ask again at once
        return synced

    async def _check_swarm(self, view: dict[str, PeerRecord]) -> None:
        """A joiner's checks at the door: the swarm's model, protocol, recipe and data plane are
        this node's, or it stops with an error naming the difference (SwarmMismatch)."""
        check_same_model(view, self.peer_id, self.model_hash)
        check_same_protocol(r for p, r in view.items() if p != self.peer_id and r.state != "stopped")
        await check_same_recipe(view, self.peer_id, self.model_hash, self.worker.workload.recipe, self.recipes)
        check_same_data_plane(view, self.peer_id, self.trust is not None)

    def _say_waiting(self, position: SwarmPosition, view: dict[str, PeerRecord]) -> None:
        log.info(
            "the swarm is closing round %d; waiting for the θ_g of step %d that opens round %d (peers: %s)",
            position.round - 1,
            position.start_step,
            position.round,
            ", ".join(
                f"{r.peer_id[-6:]} {r.state} round {r.round} {r.phase or '-'} step {r.outer_step}"
                for r in view.values()
                if r.peer_id != self.peer_id
            ),
        )

    def _say_giving_up(self, plan: SyncPlan, own: int, downloads: int) -> None:
        position = plan.position
        assert position is not None
        if plan.unservable:
            log.info(
                "the swarm's round %d is ahead on --client-mode peers only, which serve no checkpoint: "
                "training from outer step %d",
                position.round,
                own,
            )
        elif plan.waited_too_long:
            log.warning(
                "the swarm's round %d did not open within %.0fs (--join-timeout); training from outer step %d meanwhile",
                position.round,
                self.settings.swarm.join_timeout,
                own,
            )
        else:
            log.warning(
                "%d downloads in a row did not put this node in the swarm's round (it moved on, or no donor served "
                "its θ_g); training from outer step %d",
                downloads,
                own,
            )

    async def _fetch(
        self, view: dict[str, PeerRecord], steps: range, majority: bool = False, rollback: bool = False
    ) -> LoadedCheckpoint | None:
        """The newest checkpoint with its step in `steps` that the swarm serves, kept as this
        node's checkpoint of that step (the donors' bytes, verified). With `majority` (a running
        node replacing its own θ_g) a majority of the hosts it can verify must serve it; with `rollback`
        (giving up steps it made) the file must also lie within reach of its own θ_g, whoever serves
        it: when the rest of the swarm has stopped, a majority of the hosts left may be one liar, and
        a node rolled back to a lone member's θ_g of an older step at 35x ‖θ‖ (the hostile bench)."""
        s = self.settings
        skipped: list[Skipped] = []
        loaded = await fetch_from_swarm(
            view,
            self.peer_id,
            steps,
            self.model_hash,
            s.swarm.run_id,
            self.store.layout,
            self.store.state_dir,
            s.swarm.join_timeout,
            self.auth,
            keep=True,
            majority=majority,
            refresh=self.membership.members,
            bind_wait=BIND_HEARTBEATS * self.membership.beat_s(),
            judge=partial(judge_split_vote, self.worker)
            if majority or rollback
            else None,  # see catchup/trust_radius.py
            judge_every=rollback,
            skipped=skipped,
        )
        for skip in skipped:  # each one also logged, with the donors' names
            self.store.metrics.checkpoint_skips.labels(why=skip.why).inc()
        if loaded is None and steps:
            self.store.arrivals.missed(FetchMiss(steps[0], steps[-1], time.time(), tuple(skipped)))
        return loaded

    async def download(self, view: dict[str, PeerRecord], step: int, own: int, majority: bool = False) -> bool:
        """Fetch and install the swarm's checkpoint of `step` (or the next, if the swarm moved on);
        `majority`: see `_fetch`."""
        s = self.settings
        self.drop_catch_up()  # a catch-up round's prefetch is for a θ_g this download replaces
        if self.landing.in_flight:  # the download replaces the θ_g that average was for
            await self.landing.settle(s.averaging.bound_s)
            self.landing.forget()
        with self.syncing():
            loaded = await self._fetch(view, range(step, step + 2), majority, rollback=step < own)
        if loaded is None:
            log.warning("no peer could serve the checkpoint of step %d yet (this node is at outer step %d)", step, own)
            return False
        keep_inner = self.worker.trainer.inner_step > 0
        installing = time.monotonic()
        await self.store.settle_hash()  # it reads the θ_g about to be replaced
        await self.worker.call(self.worker.install, loaded, None, keep_inner)
        loaded.timings["installing"] = time.monotonic() - installing
        self.store.rehash()  # for the record and logs: off the join's path
        await self.store.settle_write()
        if loaded.step < own:
            await self.store.set_aside_after(loaded.step)
        await self.store.keep_downloaded(loaded)
        self.resync_wanted = True  # the donor's θ_g may differ slightly from its neighbours'
        stages = ", ".join(f"{stage} {seconds:.1f}s" for stage, seconds in loaded.timings.items())
        log.info(
            "in sync at outer step %d%s%s",
            loaded.step,
            f" ({stages})" if stages else "",
            "; inner optimizer state kept" if keep_inner else "",
        )
        self.publish()
        return True

    async def entering(self, round_no: int) -> None:
        """Round `round_no` starts: the first after a download is noted (see closed_under_us),
        and a catch-up round's θ_g of the next step is fetched from now on (see catch_up)."""
        if self.settings.diloco.overlap and self.catch_up_round == round_no:
            self.overlap.start(round_no)
        self.entered_round = round_no if self.joined_at is not None else None
        if self.joined_at is None:
            return
        await asyncio.wrap_future(self.worker.trainer.build_optimizer_in_background())  # the first step needs it
        position = swarm_position((await self.membership.members()).values(), self.peer_id, self.model_hash)
        log.info(
            "training round %d with the swarm (%s), %.1fs after the download began",
            round_no,
            "no other peer"
            if position is None
            else f"its open round is {position.round}, {position.peers} other peer(s)",
            time.monotonic() - self.joined_at,
        )
        self.joined_at = None

    def closed_under_us(self, view: Mapping[str, PeerRecord], round_no: int, alone: bool = False) -> bool:
        """Whether the swarm's open round moved past `round_no`, the first this node trains
        after a download, while this node trained it: its peers averaged it without this node
        (with `alone`: this node's average found no group while the swarm has peers). At most
        MAX_REENTRIES rounds in a row are given up so: a node that can never reach a group
        (unreachable, always late) trains on rather than downloading every round."""
        if self.settings.diloco.overlap or round_no != self.entered_round or self.reentries >= MAX_REENTRIES:
            return False
        position = swarm_position(view.values(), self.peer_id, self.model_hash)
        return position is not None and (alone or position.round > round_no)

    async def enter_next_round(self, round_no: int, inner: InnerResult, alone: bool = False) -> bool:
        """A joiner that arrived in a round's last seconds, whose peers averaged it before its
        first steps were done: it takes the θ_g of the next round instead of averaging alone
        (a θ_g of its own that the swarm never had). Those few steps are a Δ nobody can average
        any more; they are dropped with the round. False (the round goes on as it is) when the
        swarm turns out not to have moved on, or no peer served its θ_g.

        `alone`: this node's average found no group. Its peers may have just closed the round
        (a group formed without it a moment before), and their records show it up to a
        heartbeat later: seen as a joiner that averaged its first round alone."""
        if alone and not await swarm_moves_past(
            self.membership.members,
            self.peer_id,
            self.model_hash,
            round_no,
            BIND_HEARTBEATS * self.membership.beat_s(),
            OPEN_POLL_S,
            self.stopping,
        ):
            return False
        self.reentries += 1
        noted_before = self.store.arrivals.noted
        if not await self.sync(joining=True):
            return False
        self.store.arrivals.replacing(DroppedRound(round_no, inner.steps), noted_before)
        log.info(
            "round %d closed while this node took its first %d step(s) in it; it joined the swarm's open round",
            round_no,
            inner.steps,
        )
        self.worker.end_round_count()
        return True

    async def catch_up(self, round_no: int) -> torch.Tensor | CodedDelta | None:
        """--overlap, the first round after a download or a start from this node's own
        checkpoint: the swarm's θ_g of step `round_no` taken instead of an outer step of this
        node's own (catchup/overlap_catch_up.py), its Δ returned; None when no peer served it in
        time, and the next groups re-sync θ_g."""
        delta = await self.overlap.take(round_no)
        if delta is None:
            self.resync_wanted = True
        return delta

    def drop_catch_up(self) -> None:
        """The catch-up round ended with an average of its own to land instead: no θ_g to take."""
        self.catch_up_round = None
        self.overlap.drop()


def _say_downloading(ahead: bool, position: SwarmPosition, own: int) -> None:
    if ahead:
        log.warning(
            "this node is at outer step %d, ahead of the swarm at %d (rounds it made while cut off): giving them up "
            "for the swarm's state",
            own,
            position.start_step,
        )
    else:
        log.info(
            "the swarm is in round %d (from outer step %d), this node at outer step %d: downloading a checkpoint",
            position.round,
            position.start_step,
            own,
        )
