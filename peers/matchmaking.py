"""Group formation through the DHT: the leader by rank closes the group.

Every peer that reaches hop k of round r registers under the key
`{run_id}.group.{r}.{k}.{cell}` (the cell is its moshpit grid coordinates without dimension
k, see `grid.py`) and polls it. Views differ (a membership record or a registration reaches
one peer before another), so members do not each decide when the group is whole: the
lowest-ranked pending registrant (its leader, `leadership.py`) does. It closes when every
peer it expects there has registered, or when its own window ends, and publishes the member
list (its part of a balanced split when the registrants outnumber the target size). The others
take the list in force that names them. A peer that registered after a list closed without it
finds that list's members taken (once they confirmed it) and forms a group with whoever is
left. A follower waits for its leaders on its own clock only: past its own window, a settle
time and a grace, it passes over every pending registrant ahead of it and leads the rest.

Two lists can still be in force at once for one member (two followers taking over together),
so every member waits a short settle time, re-reads, and keeps the group the rules put it in.
Everyone who reads the same registrations and lists computes the same groups; a member that
read otherwise costs one all-reduce, as reducers reject chunks whose group id differs from
theirs. No time a peer announces orders or bounds anything here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace

from . import failpoints
from .absentees import Absentees
from .auth import SwarmAuth
from .dht_in_process import SwarmDHT
from .forming import FormedGroup, Forming, needs_resync
from .forming_reads import Admitted, FormingReads, short_ids
from .grid import split_groups
from .group_board import REGISTRATION_TTL_S, GroupBoard, Registration
from .hostile_grouping import hostile_group
from .leadership import ClosedList, Standing
from .list_settling import ListSettling
from .plan import Member
from .presence import FORMED_LAG_S

log = logging.getLogger(__name__)


UNKNOWN = "?"  # an expectation that can never be met: wait for the window
POLLS_PER_WINDOW = 2  # a window lasts at least this many of the recent slowest polls
POLL_HISTORY = 32
# past its own window and settle time, a follower still waits this long for a leader's list
# (that leader may be publishing it right now); the leader's own poll is cut half of it past
# its deadline, so that its list goes out before its followers pass it over
LEADER_GRACE_S = 2.0
# leaders a follower passes over one at a time (each after a grace of its own) before it passes
# over every pending registrant ahead of it at once: hostile or dead registrants cost it that many
# graces at most
MAX_PASSES = 2
# past its settle time, a leader waits this long at most for the members of a list that jumped
# ahead of it to confirm it (they do within a poll of their settle if they took it; they did not
# if it jumped: they wait for this leader, and most often say so at once: `Forming.to_decline`),
# before it names them itself
HOLD_S = 0.5


class Matchmaker:
    def __init__(
        self,
        dht: SwarmDHT,
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
        self.board = GroupBoard(dht, own.peer_id, auth, owner)
        self.reads = FormingReads(self.board)
        self.settling = ListSettling(self.reads, poll_interval, settle_s)
        self.absentees = Absentees()  # members benched for letting this node's groups down

    def group_key(self, round: int, hop: int, cell: str = "all") -> str:
        return f"{self.run_id}.group.{round}.{hop}.{cell}"

    async def registered(self, key: str) -> set[str]:
        """Peers with a valid, authentic registration under `key`."""
        return await self.board.registered(key)

    async def formed(self, key: str) -> dict[str, tuple[str, ...]]:
        """The group each registrant ended up in (alone counts): what the groups of the next
        hop wait for, and what confirms a list (`leadership.confirmed`)."""
        return await self.board.formed(key)

    def leader_grace(self) -> float:
        """How long past its settle a follower waits for a leader's list once every peer it
        expects has registered: an honest leader sees them too and closes within a poll, or after
        holding its list HOLD_S for one that jumped ahead of it; so that hold, a poll's sleep and
        two slow reads (`formed_lag`), never over LEADER_GRACE_S. A leader that never closes costs
        its group this, not the full grace (which still covers a leader whose window, started
        later on its own clock, has not ended yet)."""
        return min(LEADER_GRACE_S, HOLD_S + self.formed_lag())

    def formed_lag(self) -> float:
        """How much later than its group-mates a present member may publish its `formed` record, as
        this node's DHT has been answering: a poll's sleep and two of the slowest recent polls (it
        reads the list a poll later, then stores its record) — never under FORMED_LAG_S."""
        return max(FORMED_LAG_S, self.poll_interval + 2 * max(self._poll_seconds, default=0.0))

    async def form_group(
        self,
        round: int,
        hop: int,
        expected: Callable[[], Awaitable[set[str]]],
        window: float,
        target_size: int,
        cell: str = "all",
        resync: bool = False,
        admitted: Admitted | None = None,
        weight: float = 1.0,
        theta: str = "",
        share: float = 1.0,
        load: int = 1,
        last_hop: bool = False,
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
        `load` (the groups this peer stands in this hop) lets the group's deadline allow for it.
        In a grid's `last_hop`, a list closed while an expected peer is in another group of the
        key is not whole (`Forming.split_keeps_mean`), and a member benched for a first strike is
        not left out of it where it follows other hops (`Absentees.benched_again`).
        Nothing here waits longer than `window`, the settle time and LEADER_GRACE_S (plus one
        DHT write and one read, each bounded by hivemind's request timeouts) on this peer's own
        clock, whatever other peers announce.
        """
        started = time.monotonic()
        # a window must hold a couple of polls of the DHT, or a leader on a loaded host closes
        # before it has read who came (an adaptive window of a second against 2-second polls)
        window = max(window, POLLS_PER_WINDOW * max(self._poll_seconds, default=0.0))
        key = self.group_key(round, hop, cell)
        attack = failpoints.hostile(round)
        own, reg = await self._register(key, attack, window, resync, weight, theta, share, load)
        # the window runs from when this peer's registration is out, not from when it was asked
        # for: a store that asks a silent DHT node (paused, frozen) waits out two of hivemind's
        # request timeouts, and so do the other peers' stores at the same moment. Counted from
        # the start, their windows ended before they could read each other, and each averaged alone
        opened = time.monotonic()
        forming = Forming(
            key,
            own.peer_id,
            {own.peer_id: (own, reg)},
            # in a grid's last hop a member left out parts θ_g anyway: a first strike is let in
            benched=self.absentees.benched_again(round) if last_hop and hop > 0 else self.absentees.benched(round),
            split_keeps_mean=not last_hop,
        )
        if attack in ("hostile-leader", "hostile-pair") and (
            lone := await hostile_group(self.board, self.poll_interval, attack, forming, admitted, window, started)
        ):
            return lone
        group, decided, wanted, last_arrival, settled = await self._until_grouped(
            forming, expected, admitted, started, opened, window, target_size, round
        )
        # a group of one settles too where this peer passed a leader over: that leader may be
        # publishing a list naming it right now (on a loaded host its close and the follower's
        # reads take seconds), and the list ranks ahead of this peer's own. Averaging alone beside
        # it, the follower stood in every class of the next hop and the leader in its rank's only,
        # and their classes ended on two θ_g (32 nodes on 2 cores)
        if (len(group) > 1 or forming.gave_up) and not settled:
            group, decided = await self.settling.settle(forming, group, decided, admitted)
            self.absentees.pardon(round, forming.struck & set(group))
        members = [forming.registrants[p][0] for p in group]
        if all(m.client_mode for m in members):
            members = [own]  # nobody can reduce: average alone
        try:
            await self.board.publish(key, "formed", tuple(sorted(m.peer_id for m in members)))
        except Exception as e:  # noqa: BLE001  (the next hop then waits for this peer until its window ends)
            log.warning("could not publish the formed group: %s", e)
        return forming.result(members, decided, wanted - {UNKNOWN}, last_arrival, started, theta)

    async def _register(
        self,
        key: str,
        attack: str | None,
        window: float,
        resync: bool,
        weight: float,
        theta: str,
        share: float,
        load: int,
    ) -> tuple[Member, Registration]:
        """Store this peer's signed registration under `key`: (itself as a member, the registration)."""
        bandwidth = failpoints.HOSTILE_BANDWIDTH if attack == "hostile-bandwidth" else self.own.bandwidth
        reg = Registration(
            grpc_addr=self.own.grpc_addr,
            client_mode=self.own.client_mode,
            bandwidth_mbps=bandwidth,
            resync=resync,
            theta=theta,
            weight=weight if attack != "hostile-zero-weight" else 1.0,
            share=share,
            load=load,
        )
        if attack == "hostile-zero-weight":  # a test's attacker: a build that skips its own checks
            reg = reg.model_copy(update={"weight": 0.0})
        reg = reg.model_copy(update={"auth": self.auth.issue("register", reg.subject(key)) if self.auth else ""})
        await self.board.register(key, reg, window + REGISTRATION_TTL_S)
        return replace(self.own, weight=weight, bandwidth=bandwidth, share=share, load=load), reg

    async def _until_grouped(
        self,
        forming: Forming,
        expected: Callable[[], Awaitable[set[str]]],
        admitted: Admitted | None,
        started: float,
        opened: float,
        window: float,
        target_size: int,
        round_no: int,
    ) -> tuple[tuple[str, ...], ClosedList, set[str], float, bool]:
        """Poll until a list in force names this peer, or it leads and closes one: (the group,
        its list, whom this peer expected, seconds from `started` to the last registrant's
        arrival, whether it was settled already: a leader that held its list for confirmations
        read past a settle). The window runs from `opened`, when this peer's registration was out."""
        me, key = forming.me, forming.key
        deadline = opened + window
        forming.give_up_at = give_up_at = deadline + self.settle_s + LEADER_GRACE_S
        # a leader's window is a promise to the followers (they pass it over a grace after their
        # own, on their clocks): on a loaded host one poll of the DHT takes seconds, so a
        # leader's poll is cut half that grace past its deadline, and it decides with what it read
        cutoff = deadline + LEADER_GRACE_S / 2
        view = forming.standing()
        wanted: set[str] = {UNKNOWN}
        last_arrival, seen, passes = 0.0, {me}, 0
        while True:
            polled = time.monotonic()
            leading = view.leader == me
            left = cutoff - polled if leading else None
            try:
                await asyncio.wait_for(self.reads.lists(forming, admitted), left)
                view = forming.standing()
                if view.needs_formed:  # a list held by a pending registrant: has it been confirmed?
                    await asyncio.wait_for(self.reads.formed(forming), left)
                    view = forming.standing()
                wanted = await asyncio.wait_for(expected(), left)
                self._poll_seconds.append(time.monotonic() - polled)
                if view.on_hold:
                    await asyncio.wait_for(self.reads.decline(forming, view), left)
            except TimeoutError:  # the leader's deadline passed mid-poll: what it read before decides
                self._poll_seconds.append(time.monotonic() - polled)
                view = forming.standing()
            except Exception as e:  # noqa: BLE001  (hivemind's DHT reads fail with many types)
                log.warning("matchmaking lookup failed: %s; deciding with what was read before", e)
                view = forming.standing()
            if set(forming.registrants) - seen:
                last_arrival, seen = time.monotonic() - started, seen | set(forming.registrants)
            now = time.monotonic()
            if not passes and UNKNOWN not in wanted and wanted - forming.refused <= set(forming.registrants):
                # everyone this peer expects is here (or was refused): a leader that sees what it sees
                # closes within a poll, so the leader's grace runs from now, not from the end of this
                # peer's window
                forming.give_up_at = give_up_at = min(give_up_at, now + self.settle_s + self.leader_grace())
            if (group := view.group_of(me)) is not None:
                publisher = view.taken[me]
                # a list naming a registrant this peer has not read yet waits a poll or so for it
                # (a read that missed it); past this peer's own deadline, without it
                if not forming.valid()[publisher].unknown or forming.gave_up or now >= give_up_at:
                    return group, forming.lists[publisher], wanted, last_arrival, False
            elif view.leader == me:
                candidates = forming.candidates(view)
                # a peer passed over is waited for no longer (its absence leaves the group not whole)
                ready = (
                    wanted - set(view.taken) - forming.passed_over - forming.refused <= set(candidates)
                    or now >= deadline
                )
                if ready and not forming.holding(view, candidates, self.settle_s + HOLD_S):
                    group, decided = await self._close(forming, view, candidates, wanted, target_size)
                    # a list of one that led past a benched leader is held too: that leader (honest,
                    # slow once) may name this peer a moment later, and a lone peer that missed it
                    # was struck by it for its absence, and benched it back (absentees.py)
                    if forming.jumped(view, me):
                        group, decided = await self.settling.hold(forming, admitted, me)
                        return group, decided, wanted, last_arrival, True
                    return group, decided, wanted, last_arrival, False
            elif now >= give_up_at:
                passes += 1
                everyone = passes > MAX_PASSES
                gone = forming.pass_over(view, everyone=everyone)
                log.info("%s: no list from %s by this peer's own deadline; passing over", key, short_ids(sorted(gone)))
                if not everyone:  # a leader that closed nothing in time let its group down (the
                    # others passed over at once are its followers)
                    forming.struck |= set(self.absentees.strike(round_no, gone))
                forming.give_up_at = give_up_at = (
                    now + LEADER_GRACE_S
                )  # the next leader's grace: it may be taking over now
                view = forming.standing()
                continue
            await asyncio.sleep(self.poll_interval)

    async def _close(
        self, forming: Forming, view: Standing, candidates: list[str], wanted: set[str], target_size: int
    ) -> tuple[tuple[str, ...], ClosedList]:
        """As leader: this peer's part of the candidates, published (alone too: latecomers must
        not wait for it)."""
        group = _part_of(candidates, forming.me, target_size)
        # a peer in another group of this key is not missed where the next hop takes a share of
        # both; in a grid's last hop the mean lacks its share
        beside = set(view.taken) if forming.split_keeps_mean else set()
        decided = ClosedList(
            group,
            # a refused registrant is not missed: it came, and no group of honest peers takes it;
            # nor is a benched one (absentees.py), in any hop: it let this peer's groups down, and
            # a swarm that has shut a hostile member out averages whole without it
            complete=UNKNOWN not in wanted and wanted - beside - forming.refused - forming.benched <= set(candidates),
            resync=needs_resync([forming.registrants[p][1] for p in group]),
        )
        await self.board.publish(forming.key, "closed", group, decided.complete, decided.resync)
        forming.lists[forming.me] = decided
        return group, decided


def _part_of(candidates: list[str], me: str, target_size: int) -> tuple[str, ...]:
    """This peer's part of the balanced split of the candidates (itself alone if not among them)."""
    if me not in candidates:
        return (me,)
    return tuple(next(g for g in split_groups(candidates, target_size) if me in g))
