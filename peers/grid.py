"""Moshpit grid: which peers average together in each hop of an outer step.

Peers sit on a d-dimensional grid [0, M)^d. In hop k a peer averages with the peers that
share every coordinate but the k-th, carrying a (weighted mean, weight) pair from hop to
hop. On a full grid (N = M^d peers) every peer holds the exact global mean after d hops
(Ryabinin et al., 2021); with gaps or failures, the mean of what its groups could reach.

Coordinates here come from each peer's rank in an order reshuffled every outer step (a
hash of the step and the peer id), written in base M. Every peer that sees the same
membership derives the same grid without talking to anyone, the grid is as full as the
swarm allows from the first step, and the reshuffle mixes peers differently each step so a
gap (N < M^d) or a dead peer never isolates the same peers twice. Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import math


def grid_shape(num_peers: int, group_size: int, dims: int = 0) -> tuple[int, int]:
    """(M, d): M is the group size; d the hops needed for M^d >= num_peers (or `dims`)."""
    if group_size < 1 or num_peers < 0 or dims < 0:
        raise ValueError("group_size must be >= 1, num_peers and dims >= 0")
    side = max(group_size, 2)
    if dims:
        return side, dims
    if num_peers <= side:
        return side, 1
    return side, math.ceil(math.log(num_peers) / math.log(side) - 1e-9)


def shuffle_order(peer_ids: list[str], outer_step: int, salt: str = "") -> list[str]:
    """The step's order of peers: deterministic, different every step."""
    def rank_key(peer_id: str) -> bytes:
        return hashlib.sha256(f"{salt}:{outer_step}:{peer_id}".encode()).digest()
    return sorted(set(peer_ids), key=rank_key)


def coordinates(peer_ids: list[str], outer_step: int, side: int, dims: int, salt: str = "") -> dict[str, tuple[int, ...]]:
    """Each peer's grid coordinates for this outer step: its rank in base `side`.

    Ranks beyond side^dims (a swarm larger than the grid) wrap around, so groups then grow
    past `side` and are split by the matchmaker like any oversized group.
    """
    order = shuffle_order(peer_ids, outer_step, salt)
    coords = {}
    for rank, peer_id in enumerate(order):
        coords[peer_id] = tuple((rank // side**k) % side for k in range(dims))
    return coords


def hop_key(coords: tuple[int, ...], hop: int) -> str:
    """Group key of hop `hop`: the coordinates with dimension `hop` removed."""
    rest = coords[:hop] + coords[hop + 1 :]
    return "-".join(str(c) for c in rest) or "all"


def hop_groups(coords: dict[str, tuple[int, ...]], hop: int) -> dict[str, list[str]]:
    """Who shares each group key in a hop (what a peer expects to meet there)."""
    groups: dict[str, list[str]] = {}
    for peer_id, c in coords.items():
        groups.setdefault(hop_key(c, hop), []).append(peer_id)
    return {key: sorted(members) for key, members in groups.items()}
