"""The round loop: train → match → average → outer step, behind one error boundary.

Where a round ends is the pacer's call (`rounds/pacer.py`); getting into step is the joiner's
(`catchup/joiner.py`); an overlapped average lands through `rounds/landing.py`. This module strings them
together and is the only one that moves the round state (`records/state.py`). Two strategies
share one interface: `PlainRound` averages a round's Δ before the next round starts;
`OverlappedRound` (--overlap) trains the next round while it is averaged.

The error boundary: θ_g only changes in whole steps (outer step, adoption of a re-sync, a
download), so a round that raises leaves θ_g as it was; θ_l keeps its inner progress, which
the next round's Δ carries. The failure is logged with its cause, counted by type, and the
next groups are asked to re-sync θ_g. No exception inside a round ends the node.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

from dtnode.daemon.catchup.joiner import Joiner
from dtnode.daemon.checkpoints.store import CheckpointStore
from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.records.history import RoundHistory
from dtnode.daemon.records.report import RoundOutcome, RoundSummary, RunStats
from dtnode.daemon.records.state import Publisher, RoundState
from dtnode.daemon.rounds.backoff import FailureStreak
from dtnode.daemon.rounds.landing import Landing
from dtnode.daemon.rounds.pacer import EXTRAPOLATE_HEARTBEATS, READ_HEARTBEATS, FixedPacer, Pacer, SwarmPacer
from dtnode.daemon.rounds.recorder import RoundRecorder
from dtnode.daemon.rounds.run_end import run_is_over
from dtnode.daemon.rounds.strategies import OverlappedRound, PlainRound, RoundStrategy
from dtnode.daemon.stopping import pause
from dtnode.daemon.telemetry.metrics import NodeMetrics
from dtnode.daemon.training.ranks.host import HostRestartNeeded, LocalRankFailure, RankOutOfMemory
from dtnode.daemon.training.trainer import InnerResult
from dtnode.daemon.training.worker import ModelWorker
from dtnode.ops.coded import CodedDelta
from dtnode.peers import failpoints
from dtnode.peers.averager import AveragingResult, AveragingTimeout, MoshpitAverager
from dtnode.peers.membership import Membership
from dtnode.peers.part_result import DriftBound

log = logging.getLogger("dtnode")

# failures whose message says all: logged without their (always identical) call path
KNOWN_CAUSES = (LocalRankFailure, FloatingPointError, AveragingTimeout)


class RoundLoop:
    def __init__(
        self,
        settings: NodeSettings,
        peer_id: str,
        state: RoundState,
        publisher: Publisher,
        worker: ModelWorker,
        store: CheckpointStore,
        joiner: Joiner,
        landing: Landing,
        averager: MoshpitAverager,
        membership: Membership,
        stats: RunStats,
        metrics: NodeMetrics,
        history: RoundHistory,
        loss_floor: float | None,
        stopping: asyncio.Event,
        stop_flag: threading.Event,
    ):
        self.settings = settings
        self.peer_id = peer_id
        self.state = state
        self.publisher = publisher
        self.worker = worker
        self.store = store
        self.joiner = joiner
        self.landing = landing
        self.averager = averager
        self.membership = membership
        self.stats = stats
        self.metrics = metrics
        self.history = history
        self.loss_floor = loss_floor
        self.stopping = stopping
        self.stop_flag = stop_flag  # seen by the training thread
        self.needs_resync = False  # set by a failed hop or round; cleared by a clean round
        self._clips_seen = 0  # the replica's `resyncs_clipped` when `resync_clipped` last looked
        self.failures = FailureStreak()  # rounds failed in a row: the pause before the next try
        self.rounds_done = 0
        self.finished = False  # --max-rounds: the swarm's run is over
        self.model_hash = worker.workload.model_hash
        self.recorder = RoundRecorder(
            settings, peer_id, worker, store, landing, publisher, stats, metrics, history, loss_floor
        )
        self.pacer: Pacer = (
            FixedPacer(settings.diloco.inner_steps, settings.diloco.round_seconds)
            if settings.diloco.pacing == "fixed"
            else SwarmPacer(
                membership.members,
                publisher.record,
                settings.diloco.inner_steps,
                settings.diloco.round_tokens,
                joiner.closed_under_us,
                on_progress=stats.show_progress,
                read_s=READ_HEARTBEATS * settings.swarm.heartbeat_interval,
                max_extrapolation=EXTRAPOLATE_HEARTBEATS * settings.swarm.heartbeat_interval,
                own_count=lambda: (worker.trainer.round_tokens, worker.trainer.tokens_per_step),
                share_below_s=settings.swarm.heartbeat_interval,
                round_seconds=settings.diloco.round_seconds,
            )
        )
        self.strategy: RoundStrategy = OverlappedRound(self) if settings.diloco.overlap else PlainRound(self)

    def finish(
        self,
        round_no: int,
        inner: InnerResult,
        result: AveragingResult | None,
        duration: float,
        landed_after: int | None = None,
    ) -> RoundSummary:
        """The round into `/status`, the metrics, the history and the log."""
        return self.recorder.finish(round_no, inner, result, duration, landed_after)

    async def pause(self, seconds: float) -> None:
        """Sleep, or less if the node is stopping."""
        await pause(self.stopping, seconds)

    # ---- the loop ----------------------------------------------------------------------------
    async def join(self) -> None:
        """Reach the swarm's round for the first time (a download if the swarm is ahead)."""
        self.state.start_syncing()
        await self.joiner.sync(joining=True)
        self.state.ready()

    async def run(self) -> None:
        s = self.settings
        await self.publisher.publish_now()
        if s.swarm.min_peers > 1:
            log.info("waiting for %d peers (up to %.0fs)", s.swarm.min_peers, s.swarm.join_timeout)
            waiting = asyncio.ensure_future(
                self.membership.wait_for(s.swarm.min_peers, s.swarm.join_timeout, poll=s.swarm.heartbeat_interval / 2)
            )
            stopper = asyncio.ensure_future(self.stopping.wait())
            await asyncio.wait({waiting, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not waiting.done():
                waiting.cancel()
            elif len(view := waiting.result()) < s.swarm.min_peers:
                log.warning(
                    "only %d of %d peers after %.0fs; training anyway",
                    len(view),
                    s.swarm.min_peers,
                    s.swarm.join_timeout,
                )
        while not self.stopping.is_set() and not self.finished:
            await self.guarded_round()

    async def guarded_round(self) -> None:
        """One round behind the error boundary (see the module docstring)."""
        try:
            await self.strategy.run_round()
            self.failures.ended()
        except (asyncio.CancelledError, KeyboardInterrupt, RankOutOfMemory, HostRestartNeeded):
            raise
        except Exception as e:
            reason = type(e).__name__
            outer = self.worker.outer_step
            self.stats.round_ended(RoundOutcome.FAILED)
            self.metrics.round_failures.labels(reason=reason).inc()
            self.metrics.rounds.labels(outcome=RoundOutcome.FAILED.value).inc()
            backoff, repeated = self.failures.failed(e)
            if repeated:  # its traceback is in the log already
                log.error(
                    "round %d failed again (%s: %s), %d rounds in a row; trying again in %.0fs",
                    outer,
                    reason,
                    e,
                    self.failures.count,
                    backoff,
                )
            else:
                log.error(
                    "round %d failed (%s: %s); continuing from outer step %d with a re-sync",
                    outer,
                    reason,
                    e,
                    outer,
                    # a known cause, said in full by its message: a rank that died, a non-finite loss or
                    # Δ, an average past its bound (whose call path is always the same and tells an
                    # operator nothing)
                    exc_info=None if isinstance(e, KNOWN_CAUSES) else e,
                )
            self.needs_resync = True
            self.state.enter_round(outer + (1 if self.landing.in_flight else 0), outer)
            if isinstance(e, FloatingPointError):  # θ_l (and its optimizer state) are unusable
                await self.worker.call(self.worker.reset_local)
            if isinstance(e, LocalRankFailure):
                await self.restart_ranks()
            await self.pause(backoff)

    async def restart_ranks(self) -> None:
        """A local rank died: the host starts all of them again from θ_g, as the same peer."""
        if self.stopping.is_set():
            return
        try:
            await self.worker.call(self.worker.restart_ranks)
            self.metrics.rank_restarts.inc()
            log.warning("restarted the local ranks from θ_g of outer step %d", self.worker.outer_step)
        except LocalRankFailure as e:  # tried again after the next round's first step fails
            log.error("could not restart the local ranks (%s); trying again next round", e)

    async def drain(self) -> None:
        await self.strategy.drain()

    # ---- shared by both strategies -------------------------------------------------------------
    def wants_resync(self, round_no: int) -> bool:
        """Whether this round's groups also average θ_g: after a failure or a download, and on
        schedule (--consensus-every)."""
        every = self.settings.averaging.consensus_every
        scheduled = bool(every) and round_no % every == every - 1
        return self.joiner.take_resync_wish() or self.needs_resync or scheduled

    def resync_clipped(self) -> bool:
        """Whether a re-sync since the last look moved this node's state only part of the way
        (training/consensus_clip.py): it stands apart from its group, and re-syncs again."""
        clipped = self.worker.replica.resyncs_clipped
        new, self._clips_seen = clipped > self._clips_seen, clipped
        return new

    async def train_round(self) -> tuple[int, InnerResult] | None:
        """A round's inner steps, after a catch-up if the swarm left this node behind; None when
        a stop ended them. The round is the outer step being built, one past θ_g's while an
        average is in flight (--overlap)."""
        await self.joiner.sync()
        outer = self.worker.outer_step
        ahead = self.landing.in_flight or self.joiner.catch_up_round == outer + 1
        round_no = outer + (1 if ahead else 0)
        if await run_is_over(
            self.settings, self.membership, self.peer_id, self.model_hash, self.rounds_done, round_no, outer
        ):
            self.finished = True
            return None
        first = self.state.first_round is None
        self.state.train(round_no)  # published with --overlap: pacing counts this round's tokens under it
        self.state.enter_round(round_no, outer)
        if first:  # peers' hop 0 of this round waits for this node from its record's `first_round` on
            self.publisher.publish()
        await self.joiner.entering(round_no)
        inner = await self._inner_steps(round_no)
        if self.stopping.is_set():
            log.info("round %d abandoned after %d inner steps", round_no, inner.steps)
            return None
        self.stats.observe_inner(inner)
        if (p := self.pacer.progress) is not None:
            log.debug(
                "round %d ends after %d steps: swarm %.0f of %d tokens from %d peers, %.0f tok/s",
                round_no,
                inner.steps,
                p.done,
                p.target,
                p.peers,
                p.rate,
            )
        failpoints.reach("round-error", round_no)
        return round_no, inner

    async def _inner_steps(self, round_no: int) -> InnerResult:
        """Inner steps until the pacer ends the round (or --round-seconds runs out)."""
        s = self.settings
        self.stats.round_started()
        after_step = partial(self.landing.land_on_arrival, asyncio.get_running_loop()) if s.diloco.overlap else None
        deadline = self.pacer.start_round()
        self.state.begin_inner(round_no)
        following = asyncio.ensure_future(self.pacer.follow(round_no))
        try:
            inner = await self.worker.call(
                self.worker.run_inner,
                self.pacer.max_steps,
                self.stop_flag,
                deadline,
                self.pacer.keep_going,
                round_no * s.diloco.inner_steps,
                s.diloco.inner_steps,
                after_step,
            )
            if not self.stopping.is_set() and (deadline is None or time.monotonic() < deadline):
                await self.pacer.wait_for_end(self.worker.trainer.step_seconds)
            return inner
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)

    def allow_for(self, round_no: int, inner: InnerResult) -> None:
        """The outer step of this round's average may be longer than this node's own Δ when it
        trained less than an average peer of the round (`UpdateBounds.allow_for_shortfall`): fewer
        tokens (a late start), or fewer steps in the same time (a slower device, a bigger step),
        or at a lower inner rate than the swarm's (a joiner's fresh optimizer warming up again).
        A typical peer's tokens are the target's share, or what the round's peers counted where
        they trained more (`SwarmProgress.shortfall`): with the share alone, a node of a swarm's
        first round that trained its share, while peers that knew no rate yet trained on to
        2.5-4x theirs, had no allowance for their longer Δ (round 0 on 2 cores: a mean 4.6x the
        Δ of a node of 10 steps against its bound of 9.8x, and the bound of one that trained its
        share is 3x). Peers that train on after this read count when the mean is applied, by
        their group's registrations (`UpdateBounds.allow_for_group`)."""
        rate = self.worker.replica.bounds.rate_shortfall(self.worker.round_rate(round_no), inner.mean_lr)
        p = self.pacer.progress
        if p is None:
            self.worker.replica.bounds.allow_for_shortfall(1.0, rate)
            return
        self.worker.replica.bounds.allow_for_shortfall(p.shortfall(inner.tokens), rate)

    def average(
        self,
        round_no: int,
        delta: torch.Tensor | CodedDelta,
        inner: InnerResult,
        resync: bool,
        consensus_on: Callable,
        drift: DriftBound,
    ) -> asyncio.Future[AveragingResult]:
        """This round's Δ averaged over the swarm's groups (a peer that took no step still
        averages, with a negligible weight: its θ_g stays in step); a θ_g re-sync may move this
        node's state by `drift` at most (`ModelWorker.resync_bound`)."""
        replica = self.worker.replica
        return asyncio.ensure_future(
            self.averager.average(
                round_no,
                delta,
                float(max(inner.tokens, 1)),
                resync,
                lambda: consensus_on(replica.consensus_state),
                None if replica.coded else self.worker.residual,  # a coded Δ took its feedback already
                replica.delta_on_host,
                replica.params_sha256(),  # "" while it is being computed: then a re-sync asked for happens
                drift,
            )
        )
