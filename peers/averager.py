"""Moshpit averaging of one outer step's pseudo-gradient: d hops of group all-reduces.

One `MoshpitAverager` per node; `average()` runs one outer step's hops and returns the
mean with a typed report per hop. Each hop carries the running (weighted mean, weight)
pair, so tokens-processed weighting survives the hops. In each hop the peer joins the
groups of its slots (see `grid.py`): its primary slot's result is what it carries on; the
other slots make it stand for its previous group in classes nobody else of that group
covers, which is what keeps the mean exact however unevenly the hashed cells filled.

Consensus re-sync: a node that wants θ_g re-synced (on schedule, after a failed part or
hop, after a download) says so in its registration; a group in which any member asked, or
whose members announced different θ_g hashes, also averages θ_g (and the outer momentum,
when there is one) in fp32 that hop, and its members ask again in the next hops, so the
re-sync spreads over the grid like the mean of Δ does. The request is anyone's
to make (a failure is not provable), so the re-sync itself is what is bounded: weights of at
most 1 (each member's share of its previous group's mean, so every previous group counts
once), the robust rule when one is set, and a drift bound on the result of a few of the node's
own outer steps (`DriftBound`, from daemon/training/outer_replica.py), never relative to ‖θ‖.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from dtnode.ops.coded import CodedDelta

from . import failpoints
from .allreduce_report import AllReduceReport
from .auth import SwarmAuth
from .averaging_result import AveragingResult, HopReport
from .channel_pool import ChannelPool
from .deadlines import AdaptiveDeadlines
from .expectations import GroupExpectations
from .grid import cells, coordinates, first_slot, grid_shape
from .group_reduce import AveragingConfig, GroupReducer, GroupWork, as_a_group_of_one, recodes_alone
from .hops import Chain, hop0_drift, hop_load, later_hop_window, next_chains, round_bound
from .matchmaking import FormedGroup, Matchmaker
from .membership import PeerRecord
from .part_codec import Feedback
from .part_result import DriftBound
from .plan import Compression, weight_shortfall
from .reduction_registry import ReductionRegistry
from .scratch_buffers import ScratchBuffers

__all__ = ["AveragingConfig", "AveragingResult", "AveragingTimeout", "HopReport", "MoshpitAverager"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Hop:
    """What every group of one hop is formed and reduced with."""

    round_no: int
    hop: int
    dims: int
    side: int
    hop0_cells: dict[str, set[str]]
    window: float
    asked: bool  # this node asks its groups to re-sync θ_g
    theta_sha256: str  # the θ_g it would re-sync from, as its registration announces it ("": not known)
    feedback: Feedback | None  # error feedback, for the primary slot
    delta_ready: Callable[[], Awaitable[None]] | None  # hop 0 only
    fetch_theta: Callable[[], Awaitable[torch.Tensor]]
    drift: DriftBound | None  # how far a re-sync may move this node's state
    slots: int  # the groups this node stands in this hop, each an all-reduce at once (its registrations say so)
    load: int  # all-reduces that share this node's link and cores, or a group-mate's, in this hop (`hop_load`)


class AveragingTimeout(RuntimeError):
    """An outer step's averaging outlasted this node's bound of it (`round_bound`)."""


async def within_bound(work: Awaitable[None], bound: float, what: str) -> None:
    """Await `work` for at most `bound` seconds; past it, AveragingTimeout. The expiry shows only
    outside `asyncio.timeout`'s block (inside it, the work sees a cancellation, which the block
    turns into TimeoutError on its way out): caught inside, it never was, and a bare TimeoutError
    reached the round's error boundary with its traceback (CI, the kill -9 chaos trial)."""
    timer = asyncio.timeout(bound)
    try:
        async with timer:
            await work
    except TimeoutError:
        if timer.expired():
            raise AveragingTimeout(f"{what} took longer than this node's bound of {bound:.0f}s; given up") from None
        raise


@dataclass
class _Round:
    """What every hop of one outer step's averaging shares."""

    round_no: int
    population: int
    side: int
    dims: int
    hop0_cells: dict[str, set[str]]
    resync: bool  # this node asks its groups to re-sync θ_g
    # the hash of this node's θ_g as its next registration announces it ("": not known); a
    # hop's re-sync sets it to what it left this node with (`GroupOutcome.theta_sha256`)
    theta_sha256: str
    residual: torch.Tensor | None
    delta_ready: Callable[[], Awaitable[None]] | None
    consensus_state: Callable[[], Awaitable[torch.Tensor]]
    drift: DriftBound | None  # how far a re-sync may move this node's state
    theta: torch.Tensor | None = None  # θ_g and the momentum, once a hop re-syncs them
    # what hop 0's re-sync held this node's state to (`drift`, shared among its group): the bound
    # the whole re-synced state is held to where it is taken (daemon/training/outer_replica.py)
    theta_bound: DriftBound | None = None
    hops: list[HopReport] = field(default_factory=list)
    _fetching: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def fetch_theta(self) -> torch.Tensor:
        async with self._fetching:
            if self.theta is None:
                self.theta = await self.consensus_state()
        return self.theta


class MoshpitAverager:
    def __init__(
        self,
        config: AveragingConfig,
        peer_id: str,
        view: Callable[[], Awaitable[dict[str, PeerRecord]]],
        matchmaker: Matchmaker,
        registry: ReductionRegistry,
        channels: ChannelPool,
        deadlines: AdaptiveDeadlines,
        auth: SwarmAuth | None = None,
        on_phase: Callable[[str], None] = lambda phase: None,
        on_grid: Callable[[int], None] = lambda dims: None,
    ):
        self.config = config
        self.peer_id = peer_id
        self.view = view
        self.matchmaker = matchmaker
        self.registry = registry
        self.channels = channels
        self.deadlines = deadlines
        self.auth = auth
        self.on_phase = on_phase
        self.on_grid = on_grid  # the hops of the grid this average uses: the node's record says them
        self.scratch = ScratchBuffers()
        self.reducer = GroupReducer(config, peer_id, matchmaker, registry, channels, deadlines, auth)
        self.expect = GroupExpectations(
            config.run_id, config.model_hash, config.target_group_size, peer_id, view, matchmaker, deadlines
        )

    # ---- one outer step --------------------------------------------------------------------
    async def average(
        self,
        round_no: int,
        delta: torch.Tensor | CodedDelta,
        weight: float,
        resync: bool,
        consensus_state: Callable[[], Awaitable[torch.Tensor]],
        residual: torch.Tensor | None = None,
        delta_ready: Callable[[], Awaitable[None]] | None = None,
        theta_sha256: str = "",
        drift: DriftBound | None = None,
    ) -> AveragingResult:
        """Average Δ (`delta`) over the grid; the mean comes back in `delta` itself (in scratch
        buffers when this node carried it into several groups of a hop).

        `delta_ready`, when given, returns once `delta` holds Δ: its copy from the training
        device may still be under way when this starts, and hop 0's matchmaking hides it.
        `theta_sha256` is the hash of the θ_g that `consensus_state` returns ("" if not known):
        a group whose members all hold that θ_g skips a re-sync (`matchmaking.needs_resync`).
        `drift` bounds how far a re-sync may move this node's state (a node always gives it:
        daemon/training/outer_replica.py `resync_bound`; None leaves a re-sync unbounded, for tests). The whole average is bounded on this node's own clock (`round_bound`): AveragingTimeout
        past it, whatever other peers do."""
        c = self.config
        if failpoints.hostile(round_no) in ("hostile-resync", "hostile-pair"):  # a test's attacker: it must re-sync
            resync, theta_sha256 = True, ""
        population = await self.expect.population(round_no)
        self.channels.retain(await self.expect.admissible())  # channels of peers gone go
        side, dims = grid_shape(
            len(population), c.target_group_size, c.grid_dims or await self.expect.grid_dims(population)
        )
        self.on_grid(dims)
        state = _Round(
            round_no,
            len(population),
            side,
            dims,
            cells(population, round_no, side, dims, salt=c.run_id),
            resync,
            theta_sha256,
            residual,
            delta_ready,
            consensus_state,
            drift,
        )
        chains = [Chain(first_slot(coordinates(self.peer_id, round_no, side, dims, c.run_id)), delta, weight)]
        bound = round_bound(self.deadlines, dims, self.matchmaker.settle_s)

        async def hops() -> None:
            nonlocal chains
            for hop in range(dims):
                chains = await self._hop(state, hop, chains)
            if dims > 1 and state.hops:
                await self.hop0_whole_beside(state.round_no, state.hops[0])

        await within_bound(hops(), bound, f"round {round_no}: averaging its {dims} hop(s)")
        return AveragingResult(chains[0].values, chains[0].weight, state.hops, state.theta, state.theta_bound)

    async def _hop(self, state: _Round, hop: int, chains: list[Chain]) -> list[Chain]:
        """One hop: every chain's group formed and all-reduced at once; the chains of the next hop."""
        c, round_no = self.config, state.round_no
        # hop 0 waits for peers a view names, which may be gone: an adaptive window. Later
        # hops wait only for peers whose path through the groups that formed leads (or
        # may still lead) here, who are on their way: the full window, and the deadline of
        # the all-reduce they may still be in (a peer alone in its cell registers here at
        # once; with only the window, its group closed before a large model's all-reduce
        # of the last hop was over, and the others then met without it)
        if hop == 0:
            others = set(state.hop0_cells.get(chains[0].slot.key, ()))
            window = max(self.deadlines.matchmaking_window, await self.expect.last_step_of_others(round_no, others))
        else:
            numel = chains[0].values.numel()
            window = later_hop_window(self.deadlines, numel, c.wire, hop, state.population, state.side, state.dims)
        self.on_phase("matchmaking")
        outputs = self.scratch.outputs([chain.values for chain in chains])
        hop_ctx = _Hop(
            round_no,
            hop,
            state.dims,
            state.side,
            state.hop0_cells,
            window,
            # once a hop re-synced it, this node's θ is the one its hash names only where its
            # group took a majority's θ_g whole (`took_majority`); otherwise the next groups
            # re-sync it again
            state.resync or (state.theta is not None and not state.theta_sha256),
            state.theta_sha256,
            self._feedback(state.residual, hop),
            state.delta_ready if hop == 0 else None,
            state.fetch_theta,
            state.drift,
            len(chains),
            hop_load(len(chains), hop, state.population, state.side, state.dims),
        )
        report = HopReport(
            hop, chains[0].slot.key, 1, 0, 0, False, [self.peer_id], 0.0, round(window, 3), extra_groups=len(chains) - 1
        )
        self.registry.hop_begins(self.config.run_id, round_no, hop, len(chains))
        done = await asyncio.gather(
            *(self._run_slot(hop_ctx, chain, out, report) for chain, out in zip(chains, outputs, strict=True))
        )
        groups = [group for group, _, _, _ in done]
        primary, first, theta_primary, theta_hash = done[0]
        if hop == 0 and theta_primary is not None and state.drift is not None:
            state.theta_bound = hop0_drift(state.drift, primary)
        self._complete_report(report, state, hop, chains[0].slot.key, groups, first)
        if state.theta is not None and theta_primary is not None:
            if theta_primary is not state.theta:
                state.theta.copy_(theta_primary)
            state.theta_sha256 = theta_hash
        state.hops.append(report)
        after = [
            Chain(
                chain.slot,
                out if result is not None else chain.values,
                result.weight_after(chain.weight) if result is not None else chain.weight,
                chain.pooled or len(group.members) > 1,
            )
            for chain, out, (group, result, _, _) in zip(chains, outputs, done, strict=True)
        ]
        return next_chains(after, groups, round_no, hop, self.peer_id, state.side) if hop + 1 < state.dims else after

    async def hop0_whole_beside(self, round_no: int, first: HopReport) -> None:
        """Hop 0 of a grid closed without peers of this node's cell (its followers passed over a
        leader whose list came late, on a loaded host): where each of them formed a group of the
        cell's key all the same, its share went on to the next hop in that group, as a split
        cell's does, and the mean lacks nobody. The report says so: the round is whole, and the
        node does not re-sync θ_g for it. Read once, after the last hop (by then a peer that
        formed in hop 0 has published it), and only where hop 0 was not whole."""
        missing = self.expect.hop0_missing(round_no)
        if first.complete or first.group_size <= 1 or missing is None:
            return
        key, peers = missing
        peers -= set(first.benched)  # left out on purpose: not missed when the list closed either
        try:
            formed = await self.matchmaker.formed(key)
        except Exception as e:  # noqa: BLE001  (hivemind's DHT reads fail with many types)
            log.debug("round %d: could not read hop 0's formed groups: %s", round_no, e)
            return
        if all(p in formed and self.peer_id not in formed[p] for p in peers):
            first.complete, first.expected, first.formed_beside = True, first.group_size, sorted(peers)

    def _complete_report(
        self,
        report: HopReport,
        state: _Round,
        hop: int,
        primary_key: str,
        groups: list[FormedGroup],
        first: AllReduceReport | None,
    ) -> None:
        """The hop's report from its primary group (the first), and the adaptive window fed."""
        primary = groups[0]
        report.group_key, report.group_size, report.registrants = primary.key, len(primary.members), primary.registrants
        # a group its closer found whole held everyone expected (cells split unevenly, so
        # the size alone says little); otherwise what this node expected, to show the gap
        report.expected = (
            len(primary.members)
            if primary.complete
            else self.expect.hop0_size(state.hop0_cells, primary_key)
            if hop == 0
            else primary.expected
        )
        report.complete, report.matchmaking_s = all(g.complete for g in groups), round(primary.seconds, 4)
        report.waited_s = round(min(max(primary.last_arrival_lag, 0.0), primary.seconds), 4)
        report.benched = sorted({p for g in groups for p in g.benched})
        log.debug(
            "round %d hop %d: %s",
            state.round_no,
            hop,
            "; ".join(
                f"{g.key.rsplit('.', 1)[-1]} {[m.peer_id[-6:] for m in g.members]} expected {g.expected} "
                f"in {g.seconds:.2f}s"
                for g in groups
            ),
        )
        if hop == 0:  # the adaptive window is hop 0's; later hops follow the formed groups
            self.deadlines.observe_matchmaking(primary.last_arrival_lag, primary.complete)
            report.weight_shortfall = weight_shortfall(primary.members, self.peer_id)
        if first is not None:
            report.included_peers = first.included_peers

    async def _run_slot(
        self, h: _Hop, chain: Chain, out: torch.Tensor | CodedDelta, report: HopReport
    ) -> tuple[FormedGroup, AllReduceReport | None, torch.Tensor | None, str]:
        """Form this chain's group and all-reduce in it at once: a member of several groups
        must not keep one waiting while another is still forming. Returns the group, Δ's
        all-reduce, the re-synced θ_g (if the group re-synced) and its hash where known
        (`GroupOutcome.theta_sha256`)."""
        slot = chain.slot
        weight = announced = chain.weight * slot.share  # what its registration announces, and claims
        attack = failpoints.hostile(h.round_no)
        if attack == "hostile-weight":
            announced, weight = failpoints.HOSTILE_TOKENS, failpoints.HOSTILE_CLAIM
        if attack == "hostile-zero-weight":
            announced, weight = 0.0, failpoints.HOSTILE_CLAIM
        group = await self.expect.form(
            h.round_no, h.hop, h.dims, h.side, slot, h.hop0_cells, h.window, h.asked, announced, h.theta_sha256, h.slots
        )
        if h.hop == 0 and slot.primary and len(group.members) > 1:
            failpoints.reach("grouped", h.round_no)  # a test's kill: grouped, no stream sent yet
        if h.delta_ready is not None:  # hop 0's group formed; Δ is read from here on
            await h.delta_ready()
        values = chain.values
        if attack in ("hostile-delta", "hostile-weight", "hostile-bandwidth", "hostile-zero-weight"):
            scale = failpoints.HOSTILE_SCALE
            values = values.scaled(scale) if isinstance(values, CodedDelta) else values * scale
        if slot.primary:
            self.on_phase("allreduce")
        theta_in = theta_out = None
        if group.resync and len(group.members) > 1:
            if group.unasked and slot.primary:  # a θ_g that left the swarm's, found by its hash
                log.warning(
                    "round %d hop %d: the group's members hold different θ_g (hashes %s) though none "
                    "asked for a re-sync; re-syncing it",
                    h.round_no,
                    h.hop,
                    ", ".join(t[:12] or "unknown" for t in group.theta_hashes),
                )
                report.unasked_resync = True
            theta_in = await h.fetch_theta()
            # the mean goes over the state it is read from (butterfly_allreduce writes a part only
            # once it is whole and checked): no second copy of θ_g and the momentum, 8 bytes per
            # parameter. A node covering extra groups re-syncs in each at once: each has its own
            theta_out = theta_in if h.slots == 1 else torch.empty_like(theta_in)
        feedback = h.feedback if slot.primary else None
        result: AllReduceReport | None
        if len(group.members) == 1 and chain.pooled and recodes_alone(self.config):
            self.registry.slot_settled(self.config.run_id, h.round_no, h.hop, None)
            result = await as_a_group_of_one(
                self.config, h.round_no, h.hop, group, values, chain.weight, out, feedback, self.registry, self.channels
            )
            theta_hash = ""
        else:
            work = GroupWork(
                h.round_no,
                h.hop,
                h.hop + h.dims,
                group,
                values,
                weight,
                out,
                theta_in,
                theta_out,
                feedback,
                h.load,
                hop0_drift(h.drift, group) if h.drift is not None and h.hop == 0 else h.drift,
            )
            outcome = await self.reducer.reduce(work, report)
            result, theta_hash = outcome.delta, outcome.theta_sha256
        return group, result, theta_out, theta_hash

    def _feedback(self, residual: torch.Tensor | None, hop: int) -> Feedback | None:
        """int8 feeds its rounding error back at hop 0 only. A sparse code drops most of Δ: at
        hop 0 the buffer joins Δ, and at later hops (whose input is a group's mean, sent on its
        support up to LATER_HOP_WIDTH x top_k values per block) it collects what that code
        cut or rounded off, which every member of the group then owes in its next Δ: together
        they put back the mass the group's mean lost."""
        if residual is None:
            return None
        if self.config.wire.compression == Compression.SPARSE:
            return Feedback(residual, inject=hop == 0, decay=self.config.feedback_decay if hop == 0 else 1.0)
        return Feedback(residual) if hop == 0 else None
