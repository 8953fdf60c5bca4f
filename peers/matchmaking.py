"""Group formation through the DHT: the earliest registrant closes the group.

Every peer that reaches hop k of round r registers under the key
`{run_id}.group.{r}.{k}.{cell}` (the cell is its moshpit grid coordinates without dimension
k, see `grid.py`) and polls it. Views differ (a membership record or a registration reaches
one peer before another), so members do not each decide when the group is whole: the
earliest registrant not yet in a group (its leader) does. It closes when every peer it
expects there has registered, or when its window ends, and publishes the member list
(its part of a balanced split when the registrants outnumber the target size). The others
adopt the first list that names them. A peer that registered after a list closed without
it finds that list's members taken and forms a group with whoever is left; a leader still
silent after the close-by time its registration announced is left out by the followers,
which close in its stead.

Two lists can still be published at once (a leader that had not yet seen an earlier
registrant, or two followers taking over together). So every member waits a short settle
time, re-reads the lists, and keeps the earliest-published list naming it, less any member
whose own earliest list is another one. Everyone reads the same lists and so computes the
same group, and a member that has settled never sees an earlier list appear later (up to
clock skew); one that did would cost one all-reduce, as reducers reject chunks whose
group id differs from theirs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from hivemind.dht import DHT
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import failpoints
from .auth import AuthError, SwarmAuth
from .grid import split_groups
from .identity import signed_subkey, writer_of
from .plan import Member

log = logging.getLogger(__name__)


class Registration(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    grpc_addr: str = Field("", max_length=256)
    client_mode: bool = False
    bandwidth_mbps: float = Field(1000.0, gt=0, le=1e9)
    resync: bool = False  # asks the group to also average θ_g this hop (after a failure, a join)
    theta: str = Field("", max_length=64)  # sha256 of the θ_g it would re-sync from ("": not known)
    weight: float = Field(0.0, ge=0, le=1e12)  # its Δ's weight here (tokens): its streams may claim no more
    # the share of its previous group's mean it brings (moshpit classes): its weight in a θ_g re-sync
    share: float = Field(1.0, gt=0, le=1)
    registered_at: float = Field(0.0, ge=0, le=1e11)  # DHT time; the earliest registrant leads the group
    closes_by: float = Field(0.0, ge=0, le=1e11)  # DHT time by which it closes the group if it leads
    auth: str = Field("", max_length=512)

    def subject(self, key: str) -> str:
        """What the swarm-key tag of this registration signs."""
        subject = (
            f"{key}|{self.grpc_addr}|{self.client_mode}|{self.bandwidth_mbps!r}|{self.resync}|{self.theta}|"
            f"{self.weight!r}|{self.registered_at!r}|{self.closes_by!r}"
        )
        # a whole share signs as before the field existed: older peers still read the common case
        return subject if self.share == 1.0 else f"{subject}|{self.share!r}"


@dataclass(frozen=True)
class ClosedList:
    members: tuple[str, ...]
    published_at: float  # DHT time: the earliest list naming a peer is its group
    complete: bool = False  # its closer had every peer it expected (the window did not close it)
    resync: bool = False  # average θ_g too: decided once, by the closer, for all (`needs_resync`)

    def subject(self, key: str) -> str:
        """What the swarm-key tag of this list signs."""
        return f"{key}|{','.join(self.members)}|{self.published_at!r}|{self.complete}|{self.resync}"


MAX_REGISTRANTS = 4096  # per group key: a flood of fake registrations stays bounded
UNKNOWN = "?"  # an expectation that can never be met: wait for the window
LIST_TTL_S = 120.0  # closed and formed member lists outlive every hop that reads them
REGISTRATION_TTL_S = 60.0  # a registration outlives its window by this much (late readers still see it)
POLLS_PER_WINDOW = 2  # a window lasts at least this many of the recent slowest polls
POLL_HISTORY = 32
LEADER_GRACE_S = 2.0  # past its announced close-by time, a leader publishing its list is not yet silent

Registrants = dict[str, tuple[Member, Registration]]


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

    A member can force a re-sync either way (by asking); its weight there is 1 like
    everyone's, and a result that drifts too far is refused (peers/averager.py)."""
    if len(registrations) < 2:
        return False
    hashes = {r.theta for r in registrations}
    if len(hashes - {""}) > 1:
        return True
    return "" in hashes and any(r.resync for r in registrations)


class Matchmaker:
    def __init__(
        self,
        dht: DHT,
        run_id: str,
        own: Member,
        poll_interval: float = 0.15,
        auth: SwarmAuth | None = None,
        settle_s: float = 0.5,
        owner: bytes | None = None,
    ):
        self.dht = dht
        self.run_id = run_id
        self.own = own
        self.poll_interval = poll_interval
        self.auth = auth
        self.settle_s = settle_s  # how long a closed list waits for lists closed at the same time
        self._poll_seconds: deque[float] = deque(maxlen=POLL_HISTORY)  # recent polls of a group's key
        # with `owner` (this peer's `[owner:...]` key marker, as a node has), registrations and
        # member lists are written under subkeys only this peer can sign, and entries of other
        # peers count only under their own keys (identity.py): nobody overwrites another's
        # registration or list, nor writes one for an id whose key they lack
        self.owner = owner
        self.subkey: str | bytes = signed_subkey(own.peer_id, owner) if owner is not None else own.peer_id

    def _writer(self, subkey: object) -> str | None:
        """Whose entry a subkey holds: signed by its peer's own key, or (without `owner`) as named."""
        if self.owner is not None:
            return writer_of(subkey)
        return subkey if isinstance(subkey, str) and len(subkey) <= 128 else None

    def _authentic(self, purpose: str, subject: str, tag: str, peer_id: str) -> bool:
        if self.auth is None:
            return True
        try:
            self.auth.verify(purpose, subject, tag, peer_id=peer_id, single_use=False, max_age=None)
            return True
        except AuthError:
            return False

    def group_key(self, round: int, hop: int, cell: str = "all") -> str:
        return f"{self.run_id}.group.{round}.{hop}.{cell}"

    async def _registrations(self, key: str) -> Registrants:
        found = await self.dht.get(key, latest=True, return_future=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        members = {}
        for subkey, item in list(entries.items())[:MAX_REGISTRANTS]:
            peer_id = self._writer(subkey)
            try:
                reg = Registration.model_validate(item.value)
            except (ValidationError, AttributeError, TypeError):
                continue
            if peer_id is None or (not reg.client_mode and not reg.grpc_addr):
                continue
            if not self._authentic("register", reg.subject(key), reg.auth, peer_id):
                continue  # without the swarm key nobody joins our groups
            members[peer_id] = (
                Member(peer_id, reg.grpc_addr, reg.client_mode, reg.bandwidth_mbps, reg.weight, reg.share),
                reg,
            )
        return members

    async def registered(self, key: str) -> set[str]:
        """Peers with a valid, authentic registration under `key`."""
        return set(await self._registrations(key))

    async def _member_lists(self, key: str, purpose: str) -> dict[str, ClosedList]:
        found = await self.dht.get(f"{key}.{purpose}", latest=True, return_future=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        lists = {}
        for subkey, item in list(entries.items())[:MAX_REGISTRANTS]:
            peer_id = self._writer(subkey)
            value = getattr(item, "value", None)
            if not isinstance(value, dict):
                continue
            members, at = value.get("members"), value.get("at")
            if not (
                peer_id is not None
                and isinstance(members, (list, tuple))
                and len(members) <= MAX_REGISTRANTS
                and peer_id in members
                and all(isinstance(v, str) and len(v) <= 128 for v in members)
                and len(set(members)) == len(members)
                and isinstance(at, (int, float))
                and 0 <= at <= 1e11
            ):
                continue
            entry = ClosedList(tuple(members), float(at), value.get("complete") is True, value.get("resync") is True)
            if self._authentic(purpose, entry.subject(key), str(value.get("auth", "")), peer_id):
                lists[peer_id] = entry
        return lists

    async def formed(self, key: str) -> dict[str, tuple[str, ...]]:
        """The group each registrant ended up in (alone counts): what the groups of the next
        hop wait for."""
        return {p: entry.members for p, entry in (await self._member_lists(key, "formed")).items()}

    async def _publish(
        self,
        key: str,
        purpose: str,
        members: tuple[str, ...],
        complete: bool = False,
        resync: bool = False,
        at: float | None = None,  # a test's attacker backdates its list
    ) -> None:
        entry = ClosedList(members, round_time(get_dht_time()) if at is None else at, complete, resync)
        tag = self.auth.issue(purpose, entry.subject(key)) if self.auth else ""
        await self.dht.store(
            f"{key}.{purpose}",
            subkey=self.subkey,
            value={
                "members": list(members),
                "at": entry.published_at,
                "complete": complete,
                "resync": resync,
                "auth": tag,
            },
            expiration_time=get_dht_time() + LIST_TTL_S,
            return_future=True,
        )

    async def _read(
        self,
        key: str,
        admitted: Callable[[], Awaitable[set[str]]] | None,
        previous: Registrants,
        previous_lists: dict[str, ClosedList],
    ) -> tuple[Registrants, dict[str, ClosedList]]:
        """Registrants (admitted ones, this peer always) and the lists they closed, added to
        what this hop's earlier reads found.

        A read on a loaded swarm can miss records another read saw (a lookup answered by a
        node that lacks them, a membership record lapsing for a moment). A follower that read
        its leader's list and then, settling, forgot the leader's registration averaged alone
        while the group counted on it; a registration or a list, once read and checked, stays.
        """
        me = self.own.peer_id
        found, lists = await asyncio.gather(self._registrations(key), self._member_lists(key, "closed"))
        allowed = await admitted() if admitted is not None else None
        fresh = {p: v for p, v in found.items() if allowed is None or p in allowed}
        registrants = previous | fresh | {me: previous[me]}
        return registrants, {p: entry for p, entry in (previous_lists | lists).items() if p in registrants}

    async def form_group(
        self,
        round: int,
        hop: int,
        expected: Callable[[], Awaitable[set[str]]],
        window: float,
        target_size: int,
        cell: str = "all",
        resync: bool = False,
        admitted: Callable[[], Awaitable[set[str]]] | None = None,
        weight: float = 0.0,
        theta: str = "",
        share: float = 1.0,
    ) -> FormedGroup:
        """Register for (round, hop, grid cell) and return this peer's group once it closes.

        `expected` names the peers this one should meet there (as leader it closes as soon as
        they have all registered, or when `window` ends); `admitted`, when given, names every
        peer that may be grouped with this one at all (the swarm's signed membership): anyone
        can write a registration under any id, so without it a flood of made-up registrants
        would each get a part of the all-reduce and fail it. `weight` (the tokens this peer's Δ
        stands for here) is announced in the signed registration: the group's plan bounds what
        each member's streams may claim by it. `theta` (the sha256 of the θ_g this peer would
        re-sync from, "" if not known) lets the closer skip a re-sync that would change nothing.
        """
        started = time.monotonic()
        # a window must hold a couple of polls of the DHT, or a leader on a loaded host closes
        # before it has read who came (an adaptive window of a second against 2-second polls)
        window = max(window, POLLS_PER_WINDOW * max(self._poll_seconds, default=0.0))
        key = self.group_key(round, hop, cell)
        me = self.own.peer_id
        now_dht = round_time(get_dht_time())
        bandwidth = self.own.bandwidth
        attack = failpoints.hostile(round)
        if attack == "hostile-bandwidth":  # a test's attacker
            bandwidth = failpoints.HOSTILE_BANDWIDTH
        registered_at, closes_by = now_dht, round_time(now_dht + window)
        if attack == "hostile-leader":  # a test's attacker: the first registrant, closing in years
            registered_at, closes_by = 0.0, 1e11
        reg = Registration(
            grpc_addr=self.own.grpc_addr,
            client_mode=self.own.client_mode,
            bandwidth_mbps=bandwidth,
            resync=resync,
            theta=theta,
            weight=weight,
            share=share,
            registered_at=registered_at,
            closes_by=closes_by,
        )
        reg = reg.model_copy(update={"auth": self.auth.issue("register", reg.subject(key)) if self.auth else ""})
        await self.dht.store(
            key,
            subkey=self.subkey,
            value=reg.model_dump(),
            expiration_time=get_dht_time() + window + REGISTRATION_TTL_S,
            return_future=True,
        )
        if attack in ("hostile-leader", "hostile-pair"):
            hostile = await self._attack(attack, key, admitted, window, started, weight, share)
            if hostile is not None:
                return hostile
        deadline = started + window
        # a leader's window is a promise to the followers (they close in its stead a grace
        # after it): on a loaded host one poll of the DHT takes seconds, so a leader's poll
        # is cut half that grace past its deadline, and it closes with what it had read
        cutoff = deadline + LEADER_GRACE_S / 2

        def poll_left() -> float | None:
            return cutoff - time.monotonic() if candidates[0] == me else None

        own = replace(self.own, weight=weight, bandwidth=bandwidth, share=share)
        registrants: Registrants = {me: (own, reg)}
        closed: dict[str, ClosedList] = {}
        wanted: set[str] = {UNKNOWN}
        candidates: list[str] = [me]
        group: tuple[str, ...] = (me,)
        last_arrival, seen = started, {me}
        while True:
            read_at = get_dht_time()  # a list this poll misses was published after this
            polled = time.monotonic()
            try:
                registrants, closed = await asyncio.wait_for(
                    self._read(key, admitted, registrants, closed), poll_left()
                )
                if agreed := _agreed_group(closed, me):
                    group, decided = agreed
                    break  # somebody closed a group naming us
                taken = set().union(*(entry.members for entry in closed.values())) - {me}
                candidates = sorted(set(registrants) - taken, key=lambda p: (registrants[p][1].registered_at, p))
                wanted = (await asyncio.wait_for(expected(), poll_left())) - taken
                self._poll_seconds.append(time.monotonic() - polled)
            except TimeoutError:  # the leader's deadline passed mid-poll: what it read before decides
                self._poll_seconds.append(time.monotonic() - polled)  # at least this long
            except Exception as e:  # noqa: BLE001  (hivemind's DHT reads fail with many types: average alone this hop)
                log.warning("matchmaking lookup failed: %s", e)
                candidates, wanted = [me], {UNKNOWN}
            if set(candidates) - seen:
                last_arrival, seen = time.monotonic(), seen | set(candidates)
            leader = registrants[candidates[0]][1]
            if candidates[0] == me and (wanted <= set(candidates) or time.monotonic() >= deadline):
                group = _part_of(candidates, me, target_size)
            elif candidates[0] != me and read_at > leader.closes_by + self.settle_s + LEADER_GRACE_S:
                # judged by when the poll began, not ended: a poll that began before the
                # leader's list went out cannot have seen it, however long it took
                log.info(
                    "%s: leader %s did not close the group by its own deadline; closing without it",
                    key,
                    _short([candidates[0]]),
                )
                candidates = candidates[1:]
                group = _part_of(candidates, me, target_size)
            else:
                await asyncio.sleep(self.poll_interval)
                continue
            decided = ClosedList(
                group,
                0.0,
                complete=UNKNOWN not in wanted and wanted <= set(candidates),
                resync=needs_resync([registrants[p][1] for p in group]),
            )
            # published alone too: latecomers must not wait for us
            await self._publish(key, "closed", group, decided.complete, decided.resync)
            break
        if len(group) > 1:
            group, decided, registrants = await self._settle(key, group, decided, admitted, registrants, closed)
        if unknown := set(group) - set(registrants):
            log.warning(
                "%s: the group names %s, whose registration this peer cannot read; averaging alone this hop",
                key,
                _short(unknown),
            )
            group = (me,)
        members = [registrants[p][0] for p in group]
        if all(m.client_mode for m in members):
            members = [own]  # nobody can reduce: average alone
        # a list cut by the settling (a member went to an earlier list) is no longer whole
        complete = decided.complete and len(members) == len(decided.members)
        try:
            await self._publish(key, "formed", tuple(sorted(m.peer_id for m in members)))
        except Exception as e:  # noqa: BLE001  (the next hop then waits for this peer until its window ends)
            log.warning("could not publish the formed group: %s", e)
        return FormedGroup(
            key,
            members,
            len(registrants),
            time.monotonic() - started,
            complete,
            last_arrival - started,
            decided.resync and len(members) > 1,
            len(wanted - {UNKNOWN}),
            tuple(sorted({registrants[m.peer_id][1].theta for m in members if m.peer_id in registrants})),
            not any(registrants[m.peer_id][1].resync for m in members if m.peer_id in registrants),
        )

    async def _attack(
        self,
        attack: str,
        key: str,
        admitted: Callable[[], Awaitable[set[str]]] | None,
        window: float,
        started: float,
        weight: float,
        share: float,
    ) -> FormedGroup | None:
        """A test's attacker (peers/failpoints.py). `hostile-leader` never closes its group: it
        averages alone once its own window is over, and publishes nothing. `hostile-pair` closes
        a list naming itself and the first other registrant it reads, backdated to 0; the
        caller then forms its group as usual (None)."""
        me = self.own.peer_id
        if attack == "hostile-leader":
            await asyncio.sleep(min(window, 10.0))
            own = replace(self.own, weight=weight, share=share)
            return FormedGroup(key, [own], 1, time.monotonic() - started)
        while time.monotonic() - started < window:
            found = await self._registrations(key)
            allowed = await admitted() if admitted is not None else None
            others = sorted(p for p in found if p != me and (allowed is None or p in allowed))
            if others:
                await self._publish(key, "closed", (me, others[0]), resync=True, at=0.0)
                return None
            await asyncio.sleep(self.poll_interval)
        return None

    async def _settle(
        self,
        key: str,
        group: tuple[str, ...],
        decided: ClosedList,
        admitted: Callable[[], Awaitable[set[str]]] | None,
        registrants: Registrants,
        closed: dict[str, ClosedList],
    ) -> tuple[tuple[str, ...], ClosedList, Registrants]:
        """Wait out lists published at the same time as ours; keep the agreed earliest one."""
        await asyncio.sleep(self.settle_s)
        try:
            registrants, closed = await self._read(key, admitted, registrants, closed)
        except Exception as e:  # noqa: BLE001  (hivemind's DHT reads fail with many types)
            # the lists read before stand: averaging alone would fail the members counting on us
            log.warning("matchmaking lookup failed while settling: %s; keeping the lists read before", e)
        agreed, decided = _agreed_group(closed, self.own.peer_id) or (group, decided)
        if agreed != group:
            log.info(
                "%s: another list closed at the same time as %s; the group is %s", key, _short(group), _short(agreed)
            )
        return agreed, decided, registrants


def round_time(t: float) -> float:
    """DHT time to the millisecond: times compare equal after a JSON round trip."""
    return round(t, 3)


def _agreed_group(closed: dict[str, ClosedList], me: str) -> tuple[tuple[str, ...], ClosedList] | None:
    """The earliest-published list naming `me`, less members whose own earliest list is
    another (and that list, whose flags hold for the group).

    Every member that reads the same lists computes the same group.
    """
    ordered = sorted(closed, key=lambda p: (closed[p].published_at, p))

    def first_for(peer: str) -> str | None:
        return next((publisher for publisher in ordered if peer in closed[publisher].members), None)

    publisher = first_for(me)
    if publisher is None:
        return None
    return tuple(p for p in closed[publisher].members if first_for(p) == publisher), closed[publisher]


def _part_of(candidates: list[str], me: str, target_size: int) -> tuple[str, ...]:
    """This peer's part of the balanced split of the candidates (itself alone if not among them)."""
    if me not in candidates:
        return (me,)
    return tuple(next(g for g in split_groups(candidates, target_size) if me in g))


def _short(peer_ids) -> list[str]:
    """Peer ids cut to their last 6 characters, for log lines."""
    return [p[-6:] for p in peer_ids]
