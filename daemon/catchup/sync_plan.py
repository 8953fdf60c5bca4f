"""The pure plan of getting into step: from the peers' records and this node's position alone,
whether to train on, wait for the round to open, download, ask again later, or give up for
now. No I/O, so every case is a unit test; `Joiner` (joiner.py) carries the plan out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from dtnode.daemon.catchup.swarm_position import SwarmPosition, open_round, swarm_position, swarm_step
from dtnode.peers.membership import PeerRecord

MAX_SYNC_DOWNLOADS = 3  # downloads in a row that did not put a node in the swarm's round


class SyncAction(StrEnum):
    IN_STEP = "in step"  # train the open round from this node's θ_g
    NO_SWARM = "no swarm"  # no other peer trains: train alone
    WAIT = "wait"  # the open round's θ_g is still being made (its peers apply the outer step)
    DOWNLOAD = "download"  # fetch the θ_g the open round starts from
    RETRY = "retry"  # its download just found no donor, and the round has not moved: ask again a heartbeat later
    GIVE_UP = "give up"  # train on from this node's θ_g (the wait or the downloads ran out)


@dataclass(frozen=True)
class LocalPosition:
    """This node as the plan sees it."""

    peer_id: str
    model_hash: str
    outer_step: int
    max_lag: int = 0  # outer steps it may trail the swarm and still train its own round
    downloads: int = 0  # downloads already made in this sync
    failed_step: int = -1  # the θ_g step whose download just found no donor (-1: none)
    waited_too_long: bool = False  # the round has not opened within --join-timeout


@dataclass(frozen=True)
class SyncPlan:
    action: SyncAction
    position: SwarmPosition | None = None  # the swarm's open round, when there is a swarm
    ahead: bool = False  # this node made rounds the swarm never saw (cut off): they are given up
    waited_too_long: bool = False  # GIVE_UP: the round did not open in time (else: downloads ran out)
    unservable: bool = False  # GIVE_UP: only --client-mode peers are at the swarm's round (see below)

    @property
    def step(self) -> int:
        """The θ_g step to download (DOWNLOAD) or that the open round starts from."""
        return self.position.start_step if self.position is not None else -1


def plan_sync(view: Mapping[str, PeerRecord], local: LocalPosition) -> SyncPlan:
    """What to do to be in step, from the records and this node's position (no I/O).

    Behind the swarm's open round by more than `max_lag`, or ahead of it by more than a
    round plus `max_lag` (solo rounds while cut off: a branch the swarm never saw), the node
    downloads the θ_g that round starts from, once a peer holds it."""
    position = swarm_position(view.values(), local.peer_id, local.model_hash)
    if position is None:
        return SyncPlan(SyncAction.NO_SWARM)
    behind = position.start_step > local.outer_step + local.max_lag
    ahead = local.outer_step > position.start_step + 1 + local.max_lag and not _holds_the_median(view, local)
    if not behind and not ahead:
        return SyncPlan(SyncAction.IN_STEP, position)
    if not position.ready:  # its peers are still applying the outer step that opens it
        if not position.servable:
            # only --client-mode peers stand there (one that ran ahead alone after a split): no
            # donor holds or makes that θ_g, and waiting --join-timeout for it stalled an honest
            # node round after round in a pair with such a peer
            return SyncPlan(SyncAction.GIVE_UP, position, ahead, unservable=True)
        if local.waited_too_long:
            return SyncPlan(SyncAction.GIVE_UP, position, ahead, waited_too_long=True)
        return SyncPlan(SyncAction.WAIT, position, ahead)
    if local.downloads >= MAX_SYNC_DOWNLOADS:
        return SyncPlan(SyncAction.GIVE_UP, position, ahead)
    if local.failed_step == position.start_step:
        # the round's θ_g is made but not served yet: its donors still hash it, or fewer than a
        # majority of hosts hold it (the first groups out of their average). Training on from
        # here would average the round alone and go on a step behind (seen on a graceful
        # restart while the swarm averaged); a round that moved is downloaded at once
        return SyncPlan(SyncAction.RETRY, position, ahead)
    return SyncPlan(SyncAction.DOWNLOAD, position, ahead)


def _holds_the_median(view: Mapping[str, PeerRecord], local: LocalPosition) -> bool:
    """Whether this node, counted with the others, is at the swarm's step: at least half of
    the live peers, itself included, are as far as it (`swarm_step`'s upper median). Then its
    rounds are the swarm's, not a branch: in a pair whose other host restarts (its ranks, or
    the whole node) the host that trained on meanwhile keeps its rounds, and the restarted one
    downloads them; in a swarm split evenly between two steps both halves go to the newer one
    (each counting only the others, the two halves would trade places)."""
    rounds = [
        open_round(r)
        for r in view.values()
        if r.peer_id != local.peer_id and r.model_hash == local.model_hash and r.state in ("training", "averaging")
    ]
    return local.outer_step <= swarm_step([*rounds, local.outer_step]) + 1 + local.max_lag
