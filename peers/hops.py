"""The arithmetic of moshpit hops, apart from the averager that runs them: the chains a peer
carries from one hop to the next, how long a later hop's window is, how many all-reduces
share a link in a hop, and the bound on one outer step's whole averaging.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from dtnode.ops.coded import CodedDelta

from .deadlines import AdaptiveDeadlines, expected_payload_bytes
from .forming import FormedGroup
from .grid import Slot, next_slots
from .group_board import MAX_LOAD
from .matchmaking import LEADER_GRACE_S, MAX_PASSES
from .part_result import DriftBound
from .plan import WireFormat

log = logging.getLogger(__name__)


MAX_CHAINS = MAX_LOAD  # classes one peer carries through a hop at most, as its registrations may say


ROUND_BOUND_SLACK_S = 30.0  # on top of `round_bound`'s sum: a loaded host's DHT polls take seconds


@dataclass(frozen=True)
class Chain:
    """One group this peer joins in a hop, with the (mean, weight) pair it brings there."""

    slot: Slot
    values: torch.Tensor | CodedDelta
    weight: float
    # the values hold other peers' contributions (a group of two or more made them), so a group
    # beside this one may hold the same mean: see `recodes_alone`
    pooled: bool = False


def hop0_drift(drift: DriftBound, group: FormedGroup) -> DriftBound:
    """The bound on hop 0's re-sync: hop 0 averages the members' own θ_g, whose hashes they
    announced, so it is shared by the members that hold another (`DriftBound.shared`); later
    hops carry the means of earlier groups, which no hash names, and keep the whole bound."""
    return drift.shared(group.theta_apart, len(group.members))


def round_bound(deadlines: AdaptiveDeadlines, dims: int, settle_s: float) -> float:
    """The longest one outer step's averaging may take on this node's own clock: per hop, its
    matchmaking (a later hop's window holds the deadline of the all-reduce before it), the
    settle time and the graces of leaders passed over, then the all-reduces of Δ and of a θ_g
    re-sync at their longest; and a slack for slow DHT polls."""
    matchmaking = deadlines.window_max + deadlines.timeout_max + settle_s + (MAX_PASSES + 2) * LEADER_GRACE_S
    return dims * (matchmaking + 2 * deadlines.timeout_max) + ROUND_BOUND_SLACK_S


def hop_load(slots: int, hop: int, population: int, side: int, dims: int) -> int:
    """How many all-reduces of a group's size a member's streams of this hop may share a link and
    cores with: its own slots, and in a later hop of a grid the population does not fill, at
    least 2, as a group-mate may stand in two cells (which this node cannot see). A reducer on
    a deadline for one all-reduce cut the streams of a group-mate covering two: the group then
    split over which parts it averaged (a 5-node `small` swarm in pairs on 2 cores)."""
    uneven = population != side**dims
    return max(slots, 2 if hop > 0 and uneven else 1)


def later_hop_window(
    deadlines: AdaptiveDeadlines, numel: int, wire: WireFormat, hop: int, population: int, side: int, dims: int
) -> float:
    """The matchmaking window of hop `hop` > 0: the full window, and the all-reduce deadline of
    the hop before as its slowest member had it, since peers on their way may still be in it.
    Groups hold about `side` members, uneven cells up to twice that (a sparse mean's payload
    grows with its members); and a member that stood in two cells there ran two all-reduces on
    a deadline for both (`hop_load`), which this node cannot see: its window counts that load."""
    previous = hop - 1
    load = hop_load(1, previous, population, side, dims)
    return deadlines.later_hop_window(load * expected_payload_bytes(numel, 2 * side, wire, previous))


def next_chains(
    after: list[Chain], groups: list[FormedGroup], round_no: int, hop: int, peer_id: str, side: int
) -> list[Chain]:
    """The chains of hop `hop + 1`: every group's result goes on, in every class this peer
    stands for in it (a class left out would leave the groups of that class in the next hops
    without this slab); the first is primary, and at most MAX_CHAINS are carried."""
    chains = [
        Chain(slot, chain.values, chain.weight, chain.pooled)
        for chain, group in zip(after, groups, strict=True)
        for slot in next_slots(chain.slot.coords, hop + 1, [m.peer_id for m in group.members], peer_id, side)
    ]
    chains = [replace(chain, slot=replace(chain.slot, primary=i == 0)) for i, chain in enumerate(chains)]
    if len(chains) > MAX_CHAINS:
        log.debug("round %d: standing in %d classes of hop %d; carrying %d", round_no, len(chains), hop + 1, MAX_CHAINS)
        chains = chains[:MAX_CHAINS]
    return chains
