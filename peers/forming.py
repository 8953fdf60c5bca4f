"""What one peer knows of one group it is forming: the group it ends up in (`FormedGroup`),
whether that group re-syncs θ_g (`needs_resync`) and who is outvoted there (`outvoted`), and
what it has read of the group key so far (`Forming`), which a later read can add to but never
take from.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from .group_board import Registrants, Registration
from .leadership import (
    ClosedList,
    ReadList,
    Standing,
    by_rank,
    confirmable,
    confirmed,
    ranked_below,
    standing,
    valid_lists,
)
from .plan import Member


@dataclass
class FormedGroup:
    key: str
    members: list[Member]
    registrants: int
    seconds: float
    complete: bool = False  # its closer had every member it expected (the window did not close it)
    last_arrival_lag: float = 0.0  # seconds from our registration to the last registrant's
    resync: bool = False  # the group averages θ_g too (decided by its closer: `needs_resync`)
    expected: int = 0  # members it waited for when it closed
    theta_hashes: tuple[str, ...] = ()  # the distinct θ_g hashes its members announced
    unasked: bool = False  # no member asked for a re-sync (one that happens: their hashes differed)
    # the other members whose announced θ_g hash is not this node's (or is unknown): the ones a
    # re-sync could legitimately move this node's θ_g toward (`DriftBound.shared`)
    theta_apart: int = 0
    benched: tuple[str, ...] = ()  # registrants left out for letting this node's groups down (absentees.py)
    # members whose announced θ_g hash is not the one a strict majority of the group announced:
    # in a re-sync their values do not enter the mean (`outvoted`, plan.py `silent`)
    outvoted: tuple[str, ...] = ()
    # the θ_g hash a strict majority of its members announced ("" if none): what a re-sync of
    # the group leaves every member with, when no part of it failed
    majority_theta: str = ""


# The weight of a member outvoted in a re-sync, as a fraction of its share: its values do not
# enter the mean (plan.py `silent`), but a weight of 0 is refused like an unannounced one
# (plan.py `capped_weights`), and this is what it counts in a chunk that only outvoted members
# reached
OUTVOTED_SHARE = 2.0**-20


def majority_theta(registrations: dict[str, Registration]) -> str:
    """The θ_g hash a strict majority of the group announced, or "" where none did."""
    votes = Counter(r.theta for r in registrations.values() if r.theta)
    if not votes:
        return ""
    theta, count = votes.most_common(1)[0]
    return theta if 2 * count > len(registrations) else ""


def outvoted(registrations: dict[str, Registration]) -> frozenset[str]:
    """The members (by peer id) a θ_g re-sync all but leaves out: those whose announced hash
    differs from the one a strict majority of the group announced (an unknown one, "",
    differs from any). Empty when no hash holds a strict majority (a pair that disagrees, two
    halves): then every member counts by its share, as before.

    Honest members of a group hold one θ_g after a clean round, so a strict majority of them
    holding one hash is the swarm's θ_g, and a member whose hash differs (one that averaged
    alone, restarted from an older checkpoint, or forces a re-sync to pull the group toward
    values of its own) should take it, not move it: a re-sync used to count each member by its
    share, so one member of 5 that asked for a re-sync and sent 2T - θ moved every member's
    θ_g a fifth of the way to T, round after round, within the drift bound each node checks
    (issue 56, seen in the hostile bench's `hostile-pair` rows when the attacker sat in a
    group of 5). The hashes are the members' signed registrations, which every member reads
    alike, so every member computes the same weights, and the group's plan is one."""
    theta = majority_theta(registrations)
    if not theta:
        return frozenset()
    return frozenset(p for p, r in registrations.items() if r.theta != theta)


def needs_resync(registrations: list[Registration]) -> bool:
    """Whether a group also averages θ_g.

    - Members that announce two different θ_g hashes re-sync, asked or not: after a clean
      round every member holds the same θ_g bits (the means are order-independent,
      ops/ordered_mean.py), so two hashes mean one of them left the swarm's θ_g (a part that
      failed in another group, a restart from an older checkpoint) and nothing else would
      bring it back: sparse mode has no scheduled re-sync.
    - A member that asked (after a failure, a download, on schedule) and one that does not
      know its hash ("") re-sync too.
    - Otherwise not: the average of equal θ_g is that θ_g again, and an fp32 re-sync costs 4
      bytes per parameter each way (8 with an outer momentum), 30 rounds of sparse traffic.

    A member can force a re-sync either way (by asking); its weight there is its share like
    everyone's, and a result that moves θ_g farther than the swarm's recent outer steps reach
    is refused (peers/averager.py)."""
    if len(registrations) < 2:
        return False
    hashes = {r.theta for r in registrations}
    if len(hashes - {""}) > 1:
        return True
    return "" in hashes and any(r.resync for r in registrations)


@dataclass
class Forming:
    """What one peer has read of one group key during a hop, and what it decided so far.

    A read on a loaded swarm can miss records another read saw (a lookup answered by a node
    that lacks them, a membership record lapsing for a moment). A follower that read its
    leader's list and then, settling, forgot the leader's registration averaged alone while
    the group counted on it; so a registration or a list, once read and checked, stays."""

    key: str
    me: str
    registrants: Registrants
    lists: dict[str, ClosedList] = field(default_factory=dict)
    formed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    passed_over: set[str] = field(default_factory=set)  # pending registrants ahead, given up on
    struck: set[str] = field(default_factory=set)  # the leaders passed over one at a time, struck for it
    # writers whose own registration here was refused (malformed, a weight of 0, no swarm key's
    # tag): they came, and will not be in this group; nobody waits for them to the window's end
    refused: set[str] = field(default_factory=set)
    held_since: dict[str, float] = field(default_factory=dict)  # list on hold -> when first seen so
    # member -> publishers of lists it declined (it saw them on hold behind a pending leader)
    declined: dict[str, frozenset[str]] = field(default_factory=dict)
    gave_up: bool = False
    # members this node benched (absentees.py): passed over from the start, and not missed
    benched: frozenset[str] = frozenset()
    # when this peer, as a follower, gives up on the leader it waits for (its own clock)
    give_up_at: float = 0.0
    # whether a peer grouped beside this one under the key leaves the mean whole: in every hop
    # but a grid's last the next hop takes one share of each group of a key; in the last, two
    # groups of one key end with two means, and a list closed without such a peer is not whole
    # (32 nodes: a latecomer alone in hop 1 counted its round `full` with a θ_g of its own)
    split_keeps_mean: bool = True

    def __post_init__(self) -> None:
        self.passed_over |= self.benched - {self.me}

    def valid(self) -> dict[str, ReadList]:
        return valid_lists(self.key, self.lists, self.registrants)

    def standing(self) -> Standing:
        view = standing(self.key, self.registrants, self.valid(), self.formed, self.passed_over)
        now = time.monotonic()
        for publisher in view.on_hold:
            self.held_since.setdefault(publisher, now)
        return view

    def candidates(self, view: Standing) -> list[str]:
        """Registrants a leader may name: not in a list in force, not passed over."""
        return by_rank(self.key, set(self.registrants) - set(view.taken) - self.passed_over)

    def holding(self, view: Standing, candidates: list[str], hold_s: float) -> list[str]:
        """Lists on hold that name one of these candidates and may still be confirmed: seen
        less than `hold_s` ago, and not declined by most of their members (`confirmable`)."""
        now = time.monotonic()
        return [
            p
            for p, read in view.on_hold.items()
            if set(read.members) & set(candidates)
            and now - self.held_since[p] < hold_s
            and confirmable(p, read.members, self.formed, self.declined)
        ]

    def to_decline(self, view: Standing) -> frozenset[str]:
        """Every list this peer declines (its publishers): those on hold that name it, and
        those it declined before; empty when there is nothing new to say."""
        mine = self.declined.get(self.me, frozenset())
        on_me = {p for p, read in view.on_hold.items() if p != self.me and self.me in read.members}
        if on_me <= mine:
            return frozenset()
        self.declined[self.me] = mine | on_me
        return self.declined[self.me]

    def pass_over(self, view: Standing, everyone: bool) -> set[str]:
        """Give up on the leader this peer waits for (its own clock said so), or on every
        pending registrant ahead of it (`everyone`). One at a time, a follower that gave up on a
        dead leader a moment before another waits for that other to take over, and they meet."""
        if everyone:
            pending = set(self.registrants) - set(view.taken) - set(self.lists) - self.passed_over
            gone = ranked_below(self.key, self.me, pending)
        else:
            gone = {view.leader} if view.leader is not None and view.leader != self.me else set()
        self.passed_over |= gone
        self.gave_up = True
        return gone

    def jumped(self, view: Standing, publisher: str) -> frozenset[str]:
        """Registrants this peer benched that rank ahead of `publisher` and published no list:
        the publisher's list led past them, and a member that does not bench them (one that was
        not in the group they let down) still waits for them as its leader (`ListSettling.hold`)."""
        pending = set(self.registrants) - set(view.taken) - set(self.lists) - self.refused
        return frozenset(ranked_below(self.key, publisher, pending & self.benched))

    def settled_on(self, publisher: str, members: tuple[str, ...]) -> bool:
        """Whether the members of a list that led past a benched registrant settled on it: for
        this peer's own list, most of them confirmed it; for another's, no member (but this one)
        declines it without having taken it since."""
        if publisher == self.me:
            return confirmed(publisher, members, self.formed)
        return not any(
            publisher in self.declined.get(m, ()) and publisher not in self.formed.get(m, ())
            for m in members
            if m not in (self.me, publisher)
        )

    def result(
        self,
        members: list[Member],
        decided: ClosedList,
        wanted: set[str],
        last_arrival: float,
        started: float,
        theta: str,
    ) -> FormedGroup:
        """What this peer's group turned out to be, as the averager needs it."""
        # a list cut by the settling (a member went to another list) is no longer whole
        complete = decided.complete and len(members) == len(decided.members)
        registrations = [self.registrants[m.peer_id][1] for m in members]
        by_member = {m.peer_id: self.registrants[m.peer_id][1] for m in members}
        return FormedGroup(
            self.key,
            members,
            len(self.registrants),
            time.monotonic() - started,
            complete,
            last_arrival,
            decided.resync and len(members) > 1,
            len(wanted),
            tuple(sorted({r.theta for r in registrations})),
            not any(r.resync for r in registrations),
            sum(
                1
                for m in members
                if m.peer_id != self.me and (not theta or self.registrants[m.peer_id][1].theta != theta)
            ),
            tuple(sorted(self.benched & set(self.registrants))),
            tuple(sorted(outvoted(by_member))),
            majority_theta(by_member),
        )
