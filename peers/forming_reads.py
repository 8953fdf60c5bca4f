"""What a peer forming a group reads of the group's key, and the one thing it says there
before it has a group: the registrants and the lists they closed, the groups they formed and
the lists they declined (`Forming` keeps all of it, and a later read only adds to it).

Every read here is a DHT lookup that may miss an entry a moment ago's found; none is trusted
alone, which is why `Forming` merges them instead of replacing what it had.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from .forming import Forming
from .group_board import GroupBoard
from .leadership import Standing

log = logging.getLogger("dtnode.peers.matchmaking")

Admitted = Callable[[], Awaitable[set[str]]]


class FormingReads:
    """Reads of one matchmaker's group keys, through its `GroupBoard`."""

    def __init__(self, board: GroupBoard):
        self.board = board

    async def lists(self, forming: Forming, admitted: Admitted | None) -> None:
        """Registrants (admitted ones, this peer always) and the lists they closed, added to
        what this hop's earlier reads found (see `Forming`)."""
        allowed = await admitted() if admitted is not None else None
        refused: set[str] = set()
        found, lists = await asyncio.gather(
            self.board.registrations(forming.key, allowed, refused),
            self.board.member_lists(forming.key, "closed", allowed),
        )
        forming.registrants |= found
        forming.refused |= refused - set(forming.registrants)
        forming.lists |= {p: entry for p, entry in lists.items() if p in forming.registrants}

    async def formed(self, forming: Forming) -> None:
        """The groups registrants formed and the lists they declined: what confirms a list on
        hold, or says it never will be."""
        formed, declined = await asyncio.gather(self.board.formed(forming.key), self.board.declined(forming.key))
        forming.formed |= formed
        # a read adds to what earlier reads found (a lookup may miss an entry), this peer's own included
        for member, publishers in declined.items():
            forming.declined[member] = forming.declined.get(member, frozenset()) | publishers

    async def decline(self, forming: Forming, view: Standing) -> None:
        """Say that this peer will not take the lists on hold that name it (it waits for the
        leader ahead of them): their leader then need not hold its own list for them."""
        declining = forming.to_decline(view)
        if not declining:
            return
        try:
            await self.board.publish(forming.key, "declined", (forming.me, *sorted(declining)))
        except Exception as e:  # noqa: BLE001  (the leader then holds its list its full HOLD_S)
            log.warning("could not publish a declined list: %s", e)


def short_ids(peer_ids: Iterable[str]) -> list[str]:
    """Peer ids cut to their last 6 characters, for log lines."""
    return [p[-6:] for p in peer_ids]
