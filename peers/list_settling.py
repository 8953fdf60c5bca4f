"""After a peer has a list that names it: the settle that waits out lists closed at the same
time, and the hold of a list that led past a registrant this peer benched.

Views differ, so two lists can be in force at once for one member (two followers taking over
together); every member of a group of two or more waits `settle_s`, reads again, and keeps the
group the rules put it in. A list that led past a benched registrant is held until its members
settled on it (`ListSettling.hold`), since a member that did not bench that registrant still
waits for it as its leader.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .forming import Forming
from .forming_reads import Admitted, FormingReads, short_ids
from .leadership import ClosedList, Standing

log = logging.getLogger("dtnode.peers.matchmaking")


class ListSettling:
    """Settles the lists one matchmaker's groups closed on, reading through `reads`."""

    def __init__(self, reads: FormingReads, poll_interval: float, settle_s: float):
        self.reads = reads
        self.poll_interval = poll_interval
        self.settle_s = settle_s  # how long a closed list waits for lists closed at the same time

    async def settle(
        self, forming: Forming, group: tuple[str, ...], decided: ClosedList, admitted: Admitted | None
    ) -> tuple[tuple[str, ...], ClosedList]:
        """Wait out lists published at the same time as ours; keep the group the rules give. A
        list that led past a registrant this peer benched is held while a member declines it
        (`hold`)."""
        me = forming.me
        await asyncio.sleep(self.settle_s)
        try:
            await self.reads.lists(forming, admitted)
            view = forming.standing()
            if view.needs_formed or led_past_benched(forming, view):
                await self.reads.formed(forming)  # the confirmations, and the declines
        except Exception as e:  # noqa: BLE001  (hivemind's DHT reads fail with many types)
            # the lists read before stand: averaging alone would fail the members counting on us
            log.warning("matchmaking lookup failed while settling: %s; keeping the lists read before", e)
        view = forming.standing()
        agreed = view.group_of(me)
        held = agreed is not None and led_past_benched(forming, view)
        if held and agreed is not None and not forming.settled_on(view.taken[me], agreed):
            return await self.hold(forming, admitted, view.taken[me])
        if agreed is not None and await self.left_alone(forming, agreed):
            log.info(
                "%s: every other member of %s formed another group; going on alone", forming.key, short_ids(agreed)
            )
            return (me,), forming.lists[view.taken[me]]
        if agreed is None or agreed == group:
            return group, decided
        log.info(
            "%s: another list closed at the same time as %s; the group is %s",
            forming.key,
            short_ids(group),
            short_ids(agreed),
        )
        return agreed, forming.lists[view.taken[forming.me]]

    async def left_alone(self, forming: Forming, agreed: tuple[str, ...]) -> bool:
        """Whether every other member of `agreed` formed a group without this peer: each
        published a list that does not name it (a follower that passed this peer over and led
        alone, its list read late), and its `formed` record, final, names another group. This
        peer then goes on alone: with the others' shares in every class of the next hop and its
        own in its rank's classes only, their classes ended on two θ_g (a pair of hop 0, 32
        nodes on 2 cores). Reads `formed` only where such a list is in."""
        me = forming.me
        others = [m for m in agreed if m != me]
        if not others or not all(m in forming.lists and me not in forming.lists[m].members for m in others):
            return False
        try:
            await self.reads.formed(forming)
        except Exception as e:  # noqa: BLE001  (hivemind's DHT reads fail with many types)
            log.debug("%s: could not read the formed groups: %s", forming.key, e)
            return False
        return all(m in forming.formed and me not in forming.formed[m] for m in others)

    async def hold(
        self, forming: Forming, admitted: Admitted | None, publisher: str
    ) -> tuple[tuple[str, ...], ClosedList]:
        """Hold a list that led past registrants this peer benched (`Forming.jumped`): a list
        from one of them naming this peer, closed meanwhile, is the group the rules give; the
        held list stands once its members settled on it (this peer's own: most of them confirmed
        it; another's: no member still declines it), once the benched ones are gone, or once the
        followers' own clocks have passed them over (`Forming.give_up_at`).

        A bench is this node's own view. A member that was not in the group the benched peer let
        down waits for it as its leader: the list that jumped it is on hold there, and it says so
        (it declines it). When the benched peer (honest, slow once) then closed its own list, it
        named those members and this one: they took it, the list's publisher (and its members
        that benched it too) took the other, and neither group was whole (seen at 24 nodes, and
        in `drills.sh uneven`, as two groups of one cell and θ_g split). Where every member
        benched it, they take the list at once and confirm it within their settle time, and
        nobody declines it: the hold costs a leader what a settle did, and a follower nothing."""
        me = forming.me
        log.info(
            "%s: %s led past %s (benched here); holding",
            forming.key,
            publisher[-6:],
            short_ids(sorted(forming.jumped(forming.standing(), publisher))),
        )
        while True:
            try:
                await self.reads.lists(forming, admitted)
                await self.reads.formed(forming)
            except Exception as e:  # noqa: BLE001  (hivemind's DHT reads fail with many types)
                log.warning("matchmaking lookup failed while holding a list: %s", e)
            view = forming.standing()
            group = view.group_of(me)
            if group is None:  # on hold behind another pending registrant: as read before
                return forming.lists[publisher].members, forming.lists[publisher]
            if view.taken[me] != publisher:  # a list ranked ahead names this peer: the rules put it there
                return group, forming.lists[view.taken[me]]
            if (
                forming.settled_on(publisher, group)
                or not forming.jumped(view, publisher)
                or time.monotonic() >= forming.give_up_at
            ):
                return group, forming.lists[publisher]
            await asyncio.sleep(self.poll_interval)


def led_past_benched(forming: Forming, view: Standing) -> bool:
    """Whether this peer's group, as `view` has it, is another's list that led past a
    registrant this peer benched."""
    publisher = view.taken.get(forming.me)
    return publisher not in (None, forming.me) and bool(forming.jumped(view, publisher))
