"""Where the swarm is, read from the peers' records: the round a node starting now can still
enter, and the step of the θ_g that round starts from.

Medians, not maxima: one node that raced ahead alone, or announces a huge step, must not pull
everyone onto its branch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dtnode.daemon.stopping import pause
from dtnode.peers.membership import PeerRecord


def swarm_step(steps: list[int]) -> int:
    """The step most of the swarm is at: the upper median of the peers' checkpoint steps.

    A median, so a minority at odd steps (a node that made solo rounds while cut off, or
    one announcing a huge step) cannot move it; the upper one, so a swarm split evenly
    between two steps (lockstep peers finishing a round) follows the newer."""
    if not steps:
        raise ValueError("no steps")
    ordered = sorted(steps)
    return ordered[len(ordered) // 2]


@dataclass(frozen=True)
class SwarmPosition:
    """Where the swarm is, for a node about to train: the round it can still enter."""

    round: int  # the swarm's open round: the one a node starting now trains with the others
    start_step: int  # the outer step of the θ_g that round starts from (what a joiner downloads)
    ready: bool  # whether a peer holds that θ_g already (it may still be applying it)
    # whether a peer that serves checkpoints holds that θ_g or is making it (in the round before):
    # a position only --client-mode peers stand at is one nobody will ever serve
    servable: bool
    peers: int  # live peers counted


def open_round(record: PeerRecord) -> int:
    """The round a node starting now could train with this peer: its round while it is in
    inner steps or still forming its first group (which waits for peers training that round);
    the next one once a group formed or it applies the outer step (that round has closed)."""
    if record.round < 0 or not record.phase:
        return record.round_in_training
    return record.round if record.phase in ("inner", "matchmaking") else record.round + 1


def swarm_position(records, own_id: str, model_hash: str) -> SwarmPosition | None:
    """The swarm's open round (the upper median over live peers of this model: see
    `swarm_step`), or None when no other peer trains.

    A round's start step is its number, or one less for a peer whose outer step comes a round
    late (--overlap); the peers of the open round say which."""
    live = [
        r
        for r in records
        if r.peer_id != own_id and r.model_hash == model_hash and r.state in ("training", "averaging")
    ]
    if not live:
        return None
    target = swarm_step([open_round(r) for r in live])
    lags = [
        r.round - r.round_checkpoint
        for r in live
        if open_round(r) == target and r.phase == "inner" and 0 <= r.round_checkpoint <= r.round
    ]
    start = target - (max(set(lags), key=lags.count) if lags else 0)
    # a peer past `start` serves the newer θ_g (--overlap lands the round's average mid-round);
    # a --client-mode peer serves nobody (its sidecar is not reachable)
    donors = [r for r in live if not r.client_mode]
    ready = any(r.outer_step >= start or r.checkpoint_step == start for r in donors)
    servable = ready or any(max(r.outer_step, r.round) >= start - 1 for r in donors)
    return SwarmPosition(target, start, ready, servable, len(live))


async def swarm_moves_past(
    read: Callable[[], Awaitable[dict[str, PeerRecord]]],
    own_id: str,
    model_hash: str,
    round_no: int,
    within_s: float,
    poll_s: float,
    stopping: asyncio.Event,
) -> bool:
    """Whether the peers' records (`read`, re-read every `poll_s`) show the swarm's open round
    past `round_no` within `within_s` seconds. A record lags its node by up to a heartbeat: a
    node that just found no group may be looking at peers that closed the round a moment ago."""
    deadline = time.monotonic() + within_s
    while not stopping.is_set():
        position = swarm_position((await read()).values(), own_id, model_hash)
        if position is None:
            return False
        if position.round > round_no:
            return True
        if time.monotonic() >= deadline:
            return False
        await pause(stopping, poll_s)
    return False
