"""Whom a moshpit group waits for, and who may join it: the expectations behind matchmaking.

A hop-0 group waits for the peers its grid cell names in this node's view (who may be gone:
hence an adaptive window, stretched for peers still in their last, long inner step); a group
of a later hop waits for every peer whose path through the groups that really formed leads
here, or still may. A group admits only peers with a live, signed membership record, or, in
a later hop, one whose own hop-0 `formed` record of the round a read found (`_vouch`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from .deadlines import AdaptiveDeadlines
from .grid import Slot, agreed_dims, classes_of, coordinates, hop_key, split_groups
from .matchmaking import UNKNOWN, FormedGroup, Matchmaker
from .membership import PeerRecord

log = logging.getLogger(__name__)

STALENESS_S = 2.0  # how stale a peer's record of its progress may be (a heartbeat or so)
# how long a later hop still traces a peer of the round whose record has gone from the view: on a
# loaded host a peer busy in an all-reduce beats late (or the DHT read misses its beat), and a
# 6-peer swarm on 2 cores saw 4 of 5 records lapse at once mid-round (its later hops then formed
# without them, and θ_g split); a peer that crashed is given up this much after its record lapsed
LAPSE_GRACE_S = 10.0


class GroupExpectations:
    def __init__(
        self,
        run_id: str,
        model_hash: str,
        target_group_size: int,
        peer_id: str,
        view: Callable[[], Awaitable[dict[str, PeerRecord]]],
        matchmaker: Matchmaker,
        deadlines: AdaptiveDeadlines,
    ):
        self.run_id = run_id
        self.model_hash = model_hash
        self.target_group_size = target_group_size
        self.peer_id = peer_id
        self.view = view
        self.matchmaker = matchmaker
        self.deadlines = deadlines
        self._seen_round = -1
        self._seen: dict[str, float] = {}  # peers of `_seen_round`'s population: when last seen in it
        # this node's last hop-0 group: (round, key, peers its cell expected that were not in it)
        self._hop0_missing: tuple[int, str, set[str]] | None = None
        self._no_shows: tuple[int, frozenset[str]] = (-1, frozenset())  # (round, `no_shows` of it)
        # peers missing from this node's view that formed a hop-0 group of the round: (round, ids)
        self._vouched: tuple[int, frozenset[str]] = (-1, frozenset())
        self._unseen_traced: set[str] = set()  # of those, the ones this node logged tracing

    async def population(self, round_no: int) -> set[str]:
        """Peers of `round_no`: live, same model, at this step or finishing the one before."""
        return self._remember(round_no, await self.view())

    async def grid_dims(self, population: set[str]) -> int:
        """The hops of this round's grid: those most of `population` used last round, while
        they fit its size (`agreed_dims`), so that every node of the round uses one grid."""
        view = await self.view()
        published = (view[p].grid_dims for p in population - {self.peer_id} if p in view)
        return agreed_dims(len(population), self.target_group_size, published)

    async def traced_population(self, round_no: int) -> set[str]:
        """The peers a later hop traces paths through: the live population, and peers seen in
        it this round whose record has since gone from the view (not one that says it stopped
        or moved on), for LAPSE_GRACE_S after they were last seen."""
        view = await self.view()
        return self._remember(round_no, view) | self._lapsed(view)

    def _lapsed(self, view: dict[str, PeerRecord]) -> set[str]:
        """Peers of this round's population whose record is gone from `view`, seen in the last
        LAPSE_GRACE_S (not one whose record says it stopped or moved on: that one is in `view`)."""
        cutoff = time.monotonic() - LAPSE_GRACE_S
        return {p for p, seen in self._seen.items() if seen >= cutoff and p not in view}

    def _remember(self, round_no: int, view: dict[str, PeerRecord]) -> set[str]:
        live = {
            p.peer_id
            for p in view.values()
            if p.outer_step in (round_no - 1, round_no)
            and p.first_round <= round_no  # a joiner or restarted peer holds no Δ of an earlier round
            and p.model_hash == self.model_hash
            and p.state in ("training", "averaging")
        } | {self.peer_id}
        if round_no != self._seen_round:
            self._seen_round, self._seen = round_no, {}
        self._seen.update(dict.fromkeys(live, time.monotonic()))
        return live

    async def admissible(self) -> set[str]:
        """Peers a group may include: those with a live, signed membership record for this model,
        and those this round's population held whose record lapsed in the last LAPSE_GRACE_S
        (a later hop waits for them: it must also let them in)."""
        view = await self.view()
        return (
            {p.peer_id for p in view.values() if p.model_hash == self.model_hash and p.state != "stopped"}
            | self._lapsed(view)
            | self._vouched_in(self._seen_round, view)
        )

    def _vouched_in(self, round_no: int, view: dict[str, PeerRecord]) -> frozenset[str]:
        """Peers of `round_no` that this node's view lacks but that formed a hop-0 group of it."""
        vouched_round, peers = self._vouched
        return frozenset(p for p in peers if p not in view) if vouched_round == round_no else frozenset()

    def _vouch(
        self, round_no: int, dims: int, side: int, formed: dict[str, dict[str, tuple[str, ...]]]
    ) -> frozenset[str]:
        """The writers of hop-0 `formed` records of `round_no` read so far (`formed`, by key),
        each under its own cell's key: peers of the round, whatever this node's view says.

        Views lag: a node whose view lacks a peer (a 16-node swarm's first seconds) neither
        traced that peer's path into its later hops nor let it in, and its group closed `full`
        without the share the peer carried (a possible cause of a CI run's round-0 split of
        θ_g in four, its groups all `full` but for a few nodes). A peer's own signed
        record of the group it formed in hop 0 (what the later hops trace paths through) says
        it is in the round, so it is traced and admitted like a peer of the view. A record
        under another cell's key (a made-up or misplaced one) vouches for nobody."""
        found = {
            p
            for key, records in formed.items()
            for p in records
            if p != self.peer_id and self._key_of(round_no, 0, dims, self._path_of(p, round_no, side, dims)) == key
        }
        if self._vouched[0] == round_no:
            found |= self._vouched[1]
        else:
            self._unseen_traced = set()
        self._vouched = (round_no, frozenset(found))
        return self._vouched[1]

    def _path_of(self, peer: str, round_no: int, side: int, dims: int) -> tuple[int, ...]:
        """A peer's starting cell of the round (a hash of its id: the same in every view)."""
        return coordinates(peer, round_no, side, dims, self.run_id)

    def _key_of(self, round_no: int, hop: int, dims: int, path: tuple[int, ...]) -> str:
        """The group key a peer at `path` forms hop `hop` under."""
        return self.matchmaker.group_key(round_no, hop, f"d{dims}.{hop_key(path, hop)}")

    async def last_step_of_others(self, round_no: int, peers: set[str]) -> float:
        """How long hop 0 should keep its door open for peers still in their last inner step of
        this round (up to the window's bound): a paced peer may start a step that ends half a
        step after the round's end, and a slow or newly joined peer's step is long. Without
        this, the adaptive window (learned from peers that arrive together) closes on it.
        A peer whose rate is not known yet (a joiner before its second step) gets the bound."""
        view = await self.view()
        longest = 0.0
        for peer in peers - {self.peer_id}:
            record = view.get(peer)
            if record is None or record.state != "training" or record.round_in_training != round_no:
                continue
            if record.tokens_per_s > 0 and record.tokens_per_step > 0:
                longest = max(longest, record.tokens_per_step / record.tokens_per_s + STALENESS_S)
            else:
                longest = math.inf
        return min(longest, self.deadlines.window_max)

    async def no_shows(self, round_no: int) -> frozenset[str]:
        """Peers this node's hop-0 cell expected in the previous round that never registered
        under its key at all, not even after the group closed: hop 0 of `round_no` does not wait
        for them (it still takes them if they register in time).

        A record can say a peer trains this round while it never comes: one whose view of the
        DHT is broken or shadowed waits for peers it cannot see, announcing round 0 the while,
        and its cell waited out its whole window (15 s) for it each round. A peer that is only
        slow registered late, and is waited for again; one that never registers costs its
        cell one window, once. One that restarted or downloaded since (its record's
        `first_round` is past the round it missed) is a new start, waited for like any other."""
        if self._no_shows[0] == round_no:
            return self._no_shows[1]
        absent: frozenset[str] = frozenset()
        if self._hop0_missing is not None and self._hop0_missing[0] == round_no - 1:
            _, key, missing = self._hop0_missing
            view = await self.view()
            absent = frozenset(
                p
                for p in missing - await self.matchmaker.registered(key)
                if p not in view or view[p].first_round < round_no
            )
        self._no_shows = (round_no, absent)
        return absent

    def hop0_missing(self, round_no: int) -> tuple[str, set[str]] | None:
        """Hop 0 of `round_no`: its group's key and the peers of this node's cell not in it."""
        if self._hop0_missing is None or self._hop0_missing[0] != round_no:
            return None
        return self._hop0_missing[1], set(self._hop0_missing[2])

    async def alive(self, peers: set[str], round_no: int) -> set[str]:
        if UNKNOWN in peers:
            return peers
        return (peers & await self.population(round_no)) | {self.peer_id}

    def hop0_size(self, hop0_cells: dict[str, set[str]], key: str) -> int:
        """Members this node expected in its hop-0 group (an oversized cell is split)."""
        wanted = hop0_cells.get(key, set()) | {self.peer_id}
        return len(next(g for g in split_groups(wanted, self.target_group_size) if self.peer_id in g))

    async def form(
        self,
        round_no: int,
        hop: int,
        dims: int,
        side: int,
        slot: Slot,
        hop0_cells: dict[str, set[str]],
        window: float,
        resync: bool,
        weight: float = 1.0,
        theta: str = "",
        load: int = 1,
    ) -> FormedGroup:
        if hop == 0:
            wanted = hop0_cells.get(slot.key, {UNKNOWN})
            absent = await self.no_shows(round_no) if UNKNOWN not in wanted else frozenset()

            async def expected() -> set[str]:
                return await self.alive(wanted, round_no) - absent
        else:
            known: dict[str, dict[str, tuple[str, ...]]] = {}

            async def expected() -> set[str]:
                return await self.on_the_way(round_no, hop, dims, side, slot, known)

        group = await self.matchmaker.form_group(
            round_no,
            hop,
            expected,
            window,
            self.target_group_size if hop == 0 else 1 << 16,
            cell=f"d{dims}.{slot.key}",
            resync=resync,
            admitted=self.admissible,
            weight=weight,
            theta=theta,
            share=slot.share,
            load=load,
            last_hop=hop == dims - 1,
        )
        if hop == 0 and UNKNOWN not in wanted:
            self._hop0_missing = (round_no, group.key, wanted - {m.peer_id for m in group.members})
        return group

    async def on_the_way(
        self, round_no: int, hop: int, dims: int, side: int, slot: Slot, known: dict[str, dict[str, tuple[str, ...]]]
    ) -> set[str]:
        """Whom a slot of hop >= 1 waits for: every peer of the round whose path through the
        earlier hops leads here, or still may.

        A peer's path is public: its hop-0 cell is a hash of its id, and each group it formed
        (its `formed` record) fixes its classes, hence its next key. So each peer is traced
        hop by hop until its path turns elsewhere (not waited for), reaches this slot
        (waited for), or stops at a hop it has not formed yet: then it is on its way and may
        come here, unless a group of its hop-0 cell formed without it (the window of hop 0
        closed the door on it). A peer that has stopped or left the round drops out of the
        population; one whose record lapsed for a few seconds does not (`traced_population`).
        A peer this node's view lacks is traced too once its hop-0 record is read (`_vouch`).
        `known` caches the formed records read so far (a record never changes).
        """
        view = await self.view()
        population = await self.traced_population(round_no) | self._vouched_in(round_no, view)
        paths = {p: self._path_of(p, round_no, side, dims) for p in population}
        paths = {p: path for p, path in paths.items() if path[hop + 1 :] == slot.coords[hop + 1 :]}
        wanted = {self.peer_id}
        for j in range(hop):
            keys = {p: self._key_of(round_no, j, dims, path) for p, path in paths.items()}
            stale = sorted({key for p, key in keys.items() if p not in known.get(key, {})})
            for key, records in zip(stale, await asyncio.gather(*(self.matchmaker.formed(k) for k in stale))):
                known[key] = known.get(key, {}) | records
            if j == 0:  # a peer's own hop-0 record puts it in the round though a lagging view lacks it
                unseen = self._vouch(round_no, dims, side, known) - set(view)
                if fresh := unseen - self._unseen_traced:
                    self._unseen_traced |= fresh
                    log.info("round %d: tracing %s by their hop-0 records (not in this view)", round_no, sorted(fresh))
                for p in unseen - set(paths):
                    path = self._path_of(p, round_no, side, dims)
                    if path[hop + 1 :] == slot.coords[hop + 1 :]:
                        paths[p], keys[p] = path, self._key_of(round_no, 0, dims, path)
            door_closed = sorted({key for p, key in keys.items() if j == 0 and p not in known[key] and known[key]})
            registered = dict(
                zip(door_closed, await asyncio.gather(*(self.matchmaker.registered(k) for k in door_closed)))
            )
            onward: dict[str, tuple[int, ...]] = {}
            for p, path in paths.items():
                members = known[keys[p]].get(p)
                if members is None:  # not through hop j yet
                    if keys[p] not in registered or p in registered[keys[p]]:
                        wanted.add(p)
                    continue
                classes = [cls for cls, _ in classes_of(sorted(members).index(p), len(members), side)]
                if slot.coords[j] not in classes:  # it goes on in every class it stands for, none of them here
                    continue
                if j == hop - 1:
                    wanted.add(p)
                else:
                    onward[p] = path[:j] + (slot.coords[j],) + path[j + 1 :]
            paths = onward
        return wanted
