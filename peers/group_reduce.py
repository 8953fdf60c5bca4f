"""The all-reduces of one formed moshpit group: Δ in the swarm's wire format, and, when the
group re-syncs, θ_g with the outer momentum in fp32, each bounded by its own deadline.

`MoshpitAverager` (averager.py) forms the groups of each hop; a `GroupReducer` runs what a
formed group does, through `butterfly_allreduce`, and counts it into the hop's report.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from dtnode.ops.coded import CodedDelta

from . import failpoints
from .allreduce_report import AllReduceReport
from .auth import SwarmAuth
from .averaging_result import HopReport
from .butterfly import butterfly_allreduce
from .channel_pool import ChannelPool
from .deadlines import AdaptiveDeadlines, expected_payload_bytes
from .forming import OUTVOTED_SHARE
from .matchmaking import FormedGroup, Matchmaker
from .part_codec import Feedback
from .part_result import DriftBound
from .plan import FP32, Compression, GroupPlan, Member, WireFormat, make_plan
from .presence import GroupPresence
from .reduction_registry import ReductionRegistry

log = logging.getLogger(__name__)

FP32_WIRE = WireFormat(Compression.FP32)
LONE_TIMEOUT_S = 1.0  # a group of one streams nothing and serves no late result: its reduction goes at once
CUT_FRACTION = 0.9  # an all-reduce that lost a part or a sender after this share of its deadline was cut by it


@dataclass(frozen=True)
class AveragingConfig:
    run_id: str
    model_hash: str
    target_group_size: int
    grid_dims: int = 0
    wire: WireFormat = field(default_factory=WireFormat)
    chunk_elements: int = 1 << 20
    in_flight: int = 4
    trim_fraction: float | None = None
    feedback_decay: float = 1.0  # the error-feedback buffer's decay per round (sparse)


@dataclass(frozen=True)
class GroupWork:
    """One formed group's all-reduce, as the hop hands it over."""

    round_no: int
    hop: int
    theta_hop: int  # the hop number θ_g's re-sync plan is keyed by (hop + dims: apart from Δ's)
    group: FormedGroup
    values: torch.Tensor | CodedDelta
    weight: float
    out: torch.Tensor | CodedDelta
    theta: torch.Tensor | None  # θ_g and the momentum to re-sync (None: the group does not)
    theta_out: torch.Tensor | None
    feedback: Feedback | None
    load: int  # all-reduces of this size sharing this node's link at once (`hop_load`)
    drift: DriftBound | None = None  # how far a re-sync may move this node's state


@dataclass(frozen=True)
class GroupOutcome:
    """What one group's all-reduces left this member with."""

    delta: AllReduceReport | None  # Δ's all-reduce (None: a group of one, which streams nothing)
    # the hash of the θ_g its re-sync left this member with, where the group knows it: a strict
    # majority announced it, and every part of the re-sync took one of theirs ("" otherwise, or
    # with no re-sync)
    theta_sha256: str = ""


class GroupReducer:
    """Runs a formed group's all-reduces for one node, and feeds the measured rates back into
    its adaptive deadlines."""

    def __init__(
        self,
        config: AveragingConfig,
        peer_id: str,
        matchmaker: Matchmaker,
        registry: ReductionRegistry,
        channels: ChannelPool,
        deadlines: AdaptiveDeadlines,
        auth: SwarmAuth | None,
    ):
        self.config = config
        self.peer_id = peer_id
        self.matchmaker = matchmaker
        self.registry = registry
        self.channels = channels
        self.deadlines = deadlines
        self.auth = auth

    async def reduce(self, work: GroupWork, report: HopReport) -> GroupOutcome:
        """All-reduce Δ (and θ_g when the group re-syncs) in one group; counts into `report`.
        Its deadline allows for `work.load` all-reduces of this size at once, or for as many as
        the most loaded member's registration said it runs (`group_load`)."""
        c, group = self.config, work.group
        if len(group.members) <= 1:
            self.registry.slot_settled(c.run_id, work.round_no, work.hop, None)
            return GroupOutcome(None)
        work = replace(work, load=group_load(work.load, group.members))
        expected = expected_payload_bytes(work.values.numel(), len(group.members), c.wire, work.hop)
        timeout = self.deadlines.allreduce_timeout(work.load * expected)
        log.debug(
            "round %d hop %d: all-reduce in %d members, %d bytes expected (x%d at once), deadline %.1fs (%d rates measured)",
            work.round_no,
            work.hop,
            len(group.members),
            expected,
            work.load,
            timeout,
            self.deadlines.rates_measured,
        )
        plan = delta_plan(c, work.round_no, work.hop, group.members, work.values.numel(), group.key)
        self.registry.slot_settled(c.run_id, work.round_no, work.hop, plan.group_id)  # before its reduction registers
        presence = GroupPresence(
            [m.peer_id for m in group.members],
            self.peer_id,
            partial(self.matchmaker.formed, group.key),
            lag=self.matchmaker.formed_lag(),
            loads={m.peer_id: m.load for m in group.members},
        )
        result = await butterfly_allreduce(
            plan,
            self.peer_id,
            work.values,
            work.weight,
            work.out,
            self.registry,
            self.channels,
            timeout,
            in_flight=c.in_flight,
            feedback=work.feedback,
            auth=self.auth,
            trim_fraction=c.trim_fraction,
            absent=presence.absent,
        )
        if _cut_at_deadline(result, len(group.members), timeout):
            self.deadlines.observe_cut(work.load * expected, timeout)
        else:
            self.deadlines.observe_allreduce(
                result.bytes_sent + result.bytes_received, result.seconds, not result.failed_parts
            )
        log.debug(
            "round %d hop %d: all-reduce took %.2fs for %d bytes (%d parts failed)",
            work.round_no,
            work.hop,
            result.seconds,
            result.bytes_sent + result.bytes_received,
            len(result.failed_parts),
        )
        report.allreduce_s = round(max(report.allreduce_s, result.seconds), 4)
        report.timeout_s = round(timeout, 3)
        _count_into(report, result)
        members = [m.peer_id for m in group.members]
        self.matchmaker.absentees.observe(work.round_no, members, self.peer_id, result)
        if work.theta is None or work.theta_out is None:
            return GroupOutcome(result)
        sync = await self._resync(work, work.theta, work.theta_out, presence, report)
        # a part refused for moving θ_g too far: in a pair, its reducer pulled (peers/absentees.py)
        self.matchmaker.absentees.observe(work.round_no, members, self.peer_id, sync)
        return GroupOutcome(result, took_majority(sync, group))

    async def _resync(
        self,
        work: GroupWork,
        theta: torch.Tensor,
        theta_out: torch.Tensor,
        presence: GroupPresence,
        report: HopReport,
    ) -> AllReduceReport:
        """θ_g re-sync: every previous group counts the same (each member by the share of its
        group's mean it brings, at most 1: nobody's own word on tokens; two groups of a later
        hop that hold one θ_g from two members at ½ and from one at 1 then weigh it alike,
        where weight 1 each split θ_g again), by the same rule as Δ (a trimmed mean in robust
        mode), and a result that moves our state farther than `work.drift` (a few of this
        node's recent outer steps) is refused: honest θ_g differ by a few outer steps at most,
        so only a hostile member's could move it that far. Where a strict majority of the group
        announced one θ_g hash, a member that announced another is `silent` in the plan
        (`forming.outvoted`): its values do not enter the mean, and the group leaves with the
        majority's θ_g bit for bit. (It counted 2^-20 of its share before: the mean then moved
        every member's θ_g by an ulp in 4 coordinates of 10, so a group that re-synced one
        member left the θ_g that the rest of the swarm held, and a split of 32 nodes outlived
        the re-syncs of its next rounds.) OUTVOTED_SHARE is still its weight, in a chunk that
        only silent members reached and in the total weight each reducer reports."""
        c, group = self.config, work.group
        attack = failpoints.hostile(work.round_no)  # a test's attacker
        weights = {m.peer_id: m.share * (OUTVOTED_SHARE if m.peer_id in group.outvoted else 1.0) for m in group.members}
        theta_plan = make_plan(
            c.run_id,
            work.round_no,
            work.theta_hop,
            [replace(m, weight=weights[m.peer_id]) for m in group.members],
            theta.numel(),
            c.wire.block_size,
            c.chunk_elements,
            FP32,
            key=group.key,
            clip_lengths=False,
            silent=frozenset(group.outvoted),
        )
        sync = await butterfly_allreduce(
            theta_plan,
            self.peer_id,
            _hostile_theta(attack, theta),
            failpoints.HOSTILE_CLAIM if attack == "hostile-resync" else weights[self.peer_id],
            theta_out,
            self.registry,
            self.channels,
            self.deadlines.allreduce_timeout(
                2 * work.load * expected_payload_bytes(theta.numel(), len(group.members), FP32_WIRE)
            ),
            in_flight=c.in_flight,
            auth=self.auth,
            trim_fraction=c.trim_fraction,
            drift=work.drift,
            absent=presence.absent,
        )
        report.theta_resync_s = round(sync.seconds, 4)
        _count_into(report, sync)
        return sync


def took_majority(sync: AllReduceReport, group: FormedGroup) -> str:
    """The majority's θ_g hash, where a re-sync left this member with that θ_g bit for bit: every
    part whole, each with a member of the majority in it (a part only outvoted members reached
    is their mean); "" where the group had no strict majority or a part fell short."""
    if not group.majority_theta:
        return ""
    outvoted = set(group.outvoted)
    whole = all(p.ok and set(p.included) - outvoted for p in sync.parts)
    return group.majority_theta if whole else ""


def group_load(own: int, members: Iterable[Member]) -> int:
    """How many all-reduces of a group's size its slowest member may run at once: this node's own
    count, or the most any member's registration announced. Every member reads the same
    registrations, so the group's reducers cut a sender at about one deadline. A member that
    stands in 4 classes of hop 1 (its hop-0 cell-mates missed hop 0) sends 4 all-reduces' worth
    through one link and its cores; on deadlines made for 1, each of its 4 groups dropped it, and
    all 4 ended partial (32 nodes on 2 cores). A hostile announcement stretches its groups'
    deadlines no further than `timeout_max`, as a slow member would."""
    return max([own, *(m.load for m in members)])


def _hostile_theta(attack: str | None, theta: torch.Tensor) -> torch.Tensor:
    """What a test's attacker sends in a θ_g re-sync: θ x HOSTILE_SCALE (`hostile-resync`), or 2T
    - θ (`hostile-pair`), which makes a pair's mean T = PAIR_TARGET x θ; an honest node, θ."""
    if attack == "hostile-resync":
        return theta * failpoints.HOSTILE_SCALE
    if attack == "hostile-pair":
        return theta * (2 * failpoints.PAIR_TARGET - 1)
    return theta


def recodes_alone(config: AveragingConfig) -> bool:
    """Whether a member alone in a group, holding a mean that other peers' Δ went into
    (`Chain.pooled`), must still put it through the group's code.

    From hop 1 on, two groups can hold the same mean: every member of the group that made it
    carries it on, and views differ, so one class-mate may stand alone with it while others
    meet in a group beside it. A group returns a mean of one distinct value through its code,
    bit for bit as a group of one does here. Sparse's later-hop code cuts a mean to its
    LATER_HOP_WIDTH x k largest values per block, and a group whose members brought different
    means returns up to their union (3 x 2k from a group of 3): kept whole by a member alone, it
    left that member's θ_g off the others' (seen in a 6-peer sparse swarm in pairs, about one
    round in six; sparse mode has no scheduled re-sync to bring it back). int8's and fp32's
    codes give a group's result back as it is, and this peer's own Δ alone is nobody else's:
    those stay as they are, with no work."""
    return config.wire.compression == Compression.SPARSE


def delta_plan(
    config: AveragingConfig, round_no: int, hop: int, members: list[Member], numel: int, key: str
) -> GroupPlan:
    """The plan of one group's all-reduce of Δ, in the config's wire format."""
    return make_plan(
        config.run_id,
        round_no,
        hop,
        members,
        numel,
        config.wire.block_size,
        config.chunk_elements,
        config.wire.codec,
        key=key,
        top_k=config.wire.plan_top_k,
    )


async def as_a_group_of_one(
    config: AveragingConfig,
    round_no: int,
    hop: int,
    group: FormedGroup,
    values: torch.Tensor | CodedDelta,
    weight: float,
    out: torch.Tensor | CodedDelta,
    feedback: Feedback | None,
    registry: ReductionRegistry,
    channels: ChannelPool,
) -> AllReduceReport:
    """`values` into `out` as a group whose members all held them would return them: the
    same butterfly (no stream leaves this node), its code and its buffer's share of the cut
    included. The part's weight is `weight`, the chain's whole weight, as a group of
    members that each brought a share of one mean sums them back to it."""
    (own,) = group.members
    # no stream, no claim to bound
    plan = delta_plan(config, round_no, hop, [replace(own, client_mode=False, weight=0.0)], values.numel(), group.key)
    return await butterfly_allreduce(
        plan,
        own.peer_id,
        values,
        weight,
        out,
        registry,
        channels,
        LONE_TIMEOUT_S,
        in_flight=config.in_flight,
        feedback=feedback,
        trim_fraction=config.trim_fraction,
    )


def _cut_at_deadline(result: AllReduceReport, members: int, deadline: float) -> bool:
    """Whether the deadline, not a member found gone, ended this all-reduce short: a part failed
    or a sender is missing from a part that succeeded, and it ran to the deadline."""
    short = bool(result.failed_parts) or (any(p.ok for p in result.parts) and len(result.included_peers) < members)
    return short and result.seconds >= CUT_FRACTION * deadline


def _count_into(report: HopReport, result: AllReduceReport) -> None:
    """One all-reduce's bytes, failed parts and retried streams, added to its hop's report."""
    report.bytes_sent += result.bytes_sent
    report.bytes_received += result.bytes_received
    report.failed_parts += [p.reducer for p in result.failed_parts]
    report.failure_codes += [p.error.split(":", 1)[0] for p in result.failed_parts]
    report.retried_codes += result.retried
