"""Who closes a moshpit group, and which member list each registrant takes: rules every member
computes from what it has read and can check, never from a time or an order another peer
announces. Pure functions, no I/O (matchmaking.py reads the DHT and acts on the answer).

- **Rank.** A registrant's place among the registrants of a group key is sha256(key | peer id).
  Nobody can claim to come first, and the order changes with every key (every round and hop), so
  no id leads every group. The leader of the registrants not yet grouped is the lowest-ranked
  one still pending (registered, with no list of its own, and not given up on).
- **Valid lists.** A published list counts only as its publisher's own group: the publisher must
  rank lowest among the members it names. A peer can group itself with peers ranked above it,
  never take a peer away from the leader ahead of it. Ids the reader has no registration of are
  left out of a list as it reads it (a made-up id sends nobody to average alone).
- **In force.** Walking the registrants in rank order, each list takes the members it names that
  no lower-ranked list took. A pending registrant ahead of a list holds it: such a list is in
  force only once most of the other members it names confirmed it (each publishes the group it
  formed). A list closed before a latecomer registered is confirmed within a settle time; a
  list that jumped ahead of its leader never is, since its members wait for that leader: they
  say so (each declines it, `confirmable`), and the leader names them without waiting further.
- **Giving up.** A follower waits for the leaders ahead of it until its own window, a settle
  time and a grace have passed on its own clock (or, once every peer it expects has registered,
  a settle time and a grace from then: a leader that sees what it sees closes within a poll);
  then it passes over the leader, and after each further grace the next one, and leads itself
  when its turn comes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field


def rank(key: str, peer_id: str) -> bytes:
    """A registrant's place in a group key's order: lowest first."""
    return hashlib.sha256(f"{key}|{peer_id}".encode()).digest()


def by_rank(key: str, peers: Iterable[str]) -> list[str]:
    return sorted(peers, key=lambda p: (rank(key, p), p))


@dataclass(frozen=True)
class ClosedList:
    """A group as its publisher closed it."""

    members: tuple[str, ...]
    complete: bool = False  # its closer had every peer it expected (the window did not close it)
    resync: bool = False  # average θ_g too: decided once, by the closer, for all (`needs_resync`)

    def subject(self, key: str) -> str:
        """What the swarm-key tag of this list signs."""
        return f"{key}|{','.join(self.members)}|{self.complete}|{self.resync}"


@dataclass(frozen=True)
class ReadList:
    """A valid list as one reader takes it: the named members it knows, and how many it does not."""

    entry: ClosedList
    members: tuple[str, ...]
    unknown: int = 0


def valid_lists(key: str, lists: Mapping[str, ClosedList], known: Collection[str]) -> dict[str, ReadList]:
    """The lists that count, by publisher (see the module: `Valid lists`)."""
    out = {}
    for publisher, entry in lists.items():
        members = tuple(m for m in entry.members if m in known)
        if publisher not in members:
            continue
        lowest = min(members, key=lambda m: (rank(key, m), m))
        if lowest == publisher:
            out[publisher] = ReadList(entry, members, len(entry.members) - len(members))
    return out


def confirmed(publisher: str, members: Iterable[str], formed: Mapping[str, Collection[str]]) -> bool:
    """Whether most members a list names besides its publisher formed their group with it; a
    list of one, once its publisher formed alone on it: a leader that reads so names it no more
    (its list would name a member that went on alone, and the pair would part θ_g)."""
    others = [m for m in members if m != publisher]
    if not others:
        return tuple(formed.get(publisher, ())) == (publisher,)
    agreeing = sum(1 for m in others if publisher in formed.get(m, ()))
    return 2 * agreeing > len(others)


def confirmable(
    publisher: str,
    members: Iterable[str],
    formed: Mapping[str, Collection[str]],
    declined: Mapping[str, Collection[str]],
) -> bool:
    """Whether a list on hold can still be confirmed: most members it names besides its
    publisher formed their group with it or have not declined it. A member declines a list it
    sees on hold behind a pending leader (it waits for that leader, so it will not take the list
    while the leader is there): a leader holding its own list for such a list's confirmations
    need not wait out its hold once most of them declined. A decline only says sooner what a
    missing confirmation says anyway; a member that declines and then takes the list (its leader
    passed over) confirms it like any other."""
    others = [m for m in members if m != publisher]
    possible = sum(1 for m in others if publisher in formed.get(m, ()) or publisher not in declined.get(m, ()))
    return 2 * possible > len(others)


@dataclass
class Standing:
    """Where the groups of one key stand as this reader sees them (see the module)."""

    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # publisher -> members in force
    taken: dict[str, str] = field(default_factory=dict)  # member -> the publisher of its group
    leader: str | None = None  # the lowest-ranked pending registrant (None: nobody pending)
    on_hold: dict[str, ReadList] = field(default_factory=dict)  # lists behind a pending registrant
    needs_formed: bool = False  # a list was held only for want of confirmations: read `formed` to decide

    def group_of(self, peer: str) -> tuple[str, ...] | None:
        publisher = self.taken.get(peer)
        return self.groups[publisher] if publisher is not None else None


def standing(
    key: str,
    registrants: Iterable[str],
    lists: Mapping[str, ReadList],
    formed: Mapping[str, Collection[str]],
    passed_over: Collection[str] = (),
) -> Standing:
    """The groups in force, the leader, and the lists on hold (see the module: `In force`)."""
    out = Standing()
    pending_ahead = False
    for p in by_rank(key, registrants):
        if p in out.taken:
            continue
        read = lists.get(p)
        if read is not None:
            if pending_ahead and not confirmed(p, read.members, formed):
                out.on_hold[p] = read
                out.needs_formed = True
                continue
            members = tuple(m for m in read.members if m not in out.taken)
            out.groups[p] = members
            out.taken.update(dict.fromkeys(members, p))
            continue
        if p in passed_over:
            continue
        if out.leader is None:
            out.leader = p
        pending_ahead = True
    return out


def ranked_below(key: str, me: str, peers: Iterable[str]) -> set[str]:
    """The peers ranked lower than `me` (ahead of it) in this key's order."""
    mine = (rank(key, me), me)
    return {p for p in peers if (rank(key, p), p) < mine}
