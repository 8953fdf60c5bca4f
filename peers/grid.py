"""Moshpit grid: which peers average together in each hop of an outer step.

Peers sit on a d-dimensional grid [0, M)^d. In hop k a peer averages with the peers that
share every coordinate but the k-th, carrying a (weighted mean, weight) pair from hop to
hop (Ryabinin et al., 2021).

Placement must survive views that differ. A peer's starting coordinates are a hash of its
own id and the outer step (like hivemind's locally derived group keys), never its rank in a
membership view: a peer missing from one node's view moves only its own cell, and every
other peer's cell is the same in every view.

Hashed cells are uneven (a cell may hold 1 or 5 peers), which alone would leave the mean
inexact after d hops. So from hop 1 on, the coordinate of the dimension just averaged is
replaced by a *class* taken from the peer's rank in the group it has just left, a list
every member of that group agreed on, so no view enters here either. Each group hands out
all M classes among its members: a member of a small group stands for it in several
classes (it joins several groups of the next hop, and carries each of their results on,
its own result taken from the first), and two members of a group larger than M that share
a class split its weight. Every group of the next hop then holds exactly one share of every
previous group of its slab, so after d hops every peer holds the exact token-weighted
global mean, whatever the cell sizes were. Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

CELL_FILL = 2  # a grid's hop-0 cells hold at most this many groups' worth of peers on average


def grid_shape(num_peers: int, group_size: int, dims: int = 0) -> tuple[int, int]:
    """(M, d): M is the group size; d (or `dims`) the fewest hops, 2 at least once the peers
    overfill one group, whose hop-0 cells hold at most CELL_FILL * M peers on average.

    Not the d with M^d >= n: that grid's cells run nearly empty just past a power of M (24
    peers in groups of 4 got 3 hops over 64 cells, most groups of hop 0 one or two peers,
    who then stood in up to 4 groups each of hop 1). A cell holding more than M splits into
    groups of at most M (`split_groups`), which costs nothing, and the next hop takes one
    share of every one of them, so the mean stays exact. One group (d = 1) must not split,
    so it holds M peers at most."""
    if group_size < 1 or num_peers < 0 or dims < 0:
        raise ValueError("group_size must be >= 1, num_peers and dims >= 0")
    side = max(group_size, 2)
    if dims:
        return side, dims
    if num_peers <= side:
        return side, 1
    hops = 2
    while num_peers > CELL_FILL * side**hops:
        hops += 1
    return side, hops


def fits(dims: int, num_peers: int, side: int) -> bool:
    """Whether a grid of `dims` hops still serves `num_peers` peers well enough to keep it (a
    band twice as wide each way as `grid_shape`'s, so a swarm near one of its bounds does not
    flip between two grids from round to round)."""
    if dims == 1:
        return num_peers <= side
    lowest = max(side, side ** (dims - 1) // CELL_FILL)  # a swarm that fits one group is one group
    return dims >= 2 and lowest < num_peers <= 2 * CELL_FILL * side**dims


def agreed_dims(num_peers: int, group_size: int, published: Iterable[int]) -> int:
    """The hops of this round's grid: the dims most peers of the population used last round,
    while they still fit this node's count (`fits`); this node's own `grid_shape` otherwise.

    Every node of a round must use one grid (a node on 2 hops and one on 3 never share a group
    key, and their later hops wait for each other in vain), but counts differ between views: on
    a loaded 24-node swarm, views held 9 to 24 peers. Following the majority of the records
    makes one grid stick while the swarm's size drifts within the band, and a swarm that grows
    past it moves to the next grid as its nodes see it, once. Only a strict majority counts, so
    a minority of peers publishing some other value moves nobody; a majority can only pick
    among grids that fit."""
    side, own = grid_shape(num_peers, group_size)
    votes = [d for d in published if d > 0]
    if not votes:
        return own
    most, count = Counter(votes).most_common(1)[0]
    return most if 2 * count > len(votes) and fits(most, num_peers, side) else own


def coordinates(peer_id: str, outer_step: int, side: int, dims: int, salt: str = "") -> tuple[int, ...]:
    """A peer's starting cell for this outer step: a function of its own id and the step only."""
    digest = hashlib.sha256(f"{salt}:{outer_step}:{peer_id}".encode()).digest()
    return tuple(int.from_bytes(digest[4 * k : 4 * k + 4], "big") % side for k in range(dims))


def hop_key(coords: tuple[int, ...], hop: int) -> str:
    """Group key of hop `hop`: the coordinates with dimension `hop` removed."""
    rest = coords[:hop] + coords[hop + 1 :]
    return "-".join(str(c) for c in rest) or "all"


def classes_of(rank: int, group_size: int, side: int) -> list[tuple[int, float]]:
    """The classes (and weight shares) the member at `rank` of a group stands for in the next hop.

    Together the members of a group cover each class 0..side-1 with total share 1.
    """
    if not 0 <= rank < group_size:
        raise ValueError("rank out of range")
    if group_size >= side:
        cls = rank % side
        holders = len(range(cls, group_size, side))
        return [(cls, 1.0 / holders)]
    return [(cls, 1.0) for cls in range(rank, side, group_size)]


@dataclass(frozen=True)
class Slot:
    """One group a peer joins in a hop: its key, the share of its weight it brings, and
    whether this group's result is the peer's own in the end (its primary slot)."""

    key: str
    share: float
    primary: bool
    coords: tuple[int, ...]  # the coordinates this slot stands at (the next hop's slots derive from them)


def first_slot(coords: tuple[int, ...]) -> Slot:
    return Slot(hop_key(coords, 0), 1.0, True, coords)


def next_slots(coords: tuple[int, ...], hop: int, group: list[str], own_id: str, side: int) -> list[Slot]:
    """This peer's slots in `hop` (>= 1), from the agreed member list of its group in hop - 1."""
    ordered = sorted(group)
    slots: list[Slot] = []
    for cls, share in classes_of(ordered.index(own_id), len(ordered), side):
        moved = coords[: hop - 1] + (cls,) + coords[hop:]
        slots.append(Slot(hop_key(moved, hop), share, not slots, moved))
    return slots


def split_groups(peer_ids: Iterable[str], target_size: int) -> list[list[str]]:
    """Balanced, deterministic split of an id list into groups of at most target_size."""
    ordered = sorted(peer_ids)
    count = max(1, math.ceil(len(ordered) / max(target_size, 1)))
    return [ordered[len(ordered) * g // count : len(ordered) * (g + 1) // count] for g in range(count)]


def cells(population: Iterable[str], outer_step: int, side: int, dims: int, salt: str = "") -> dict[str, set[str]]:
    """Who this population puts under each hop-0 group key: whom a node waits for in hop 0.

    Later hops follow each peer's path through the groups that really formed (see
    `MoshpitAverager._on_the_way`), not a simulation from a view: views differ, and the
    groups that form decide the next slots.
    """
    by_key: dict[str, set[str]] = {}
    for p in set(population):
        by_key.setdefault(hop_key(coordinates(p, outer_step, side, dims, salt), 0), set()).add(p)
    return by_key
