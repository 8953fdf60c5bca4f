"""A test's attacker in group formation (the `hostile-leader` and `hostile-pair` failpoints,
peers/failpoints.py): what a build that skips the rules does, so that tests and the hostile
bench can show what it costs the honest members. Never reached without a failpoint set.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from .forming import FormedGroup, Forming
from .group_board import GroupBoard
from .leadership import by_rank, ranked_below


async def hostile_group(
    board: GroupBoard,
    poll_interval: float,
    attack: str,
    forming: Forming,
    admitted: Callable[[], Awaitable[set[str]]] | None,
    window: float,
    started: float,
) -> FormedGroup | None:
    """`hostile-leader` never closes its group: it averages alone once its own window is over,
    and publishes nothing. `hostile-pair` closes a list naming itself and the first registrant
    ranked after it the moment it reads one; the caller then forms its group as usual (None)."""
    me, key = forming.me, forming.key
    if attack == "hostile-leader":
        await asyncio.sleep(min(window, 10.0))
        return FormedGroup(key, [forming.registrants[me][0]], 1, time.monotonic() - started)
    while time.monotonic() - started < window:
        allowed = await admitted() if admitted is not None else None
        others = by_rank(key, set(await board.registrations(key, allowed)) - {me})
        after = [p for p in others if p not in ranked_below(key, me, others)]
        if after:
            await board.publish(key, "closed", (me, after[0]), resync=True)
            return None
        await asyncio.sleep(poll_interval)
    return None
