"""Failure detection faster than a deadline, for the parts of one butterfly all-reduce.

A reducer dials the senders whose stream has not begun and drops those whose connection fails
again and again (killed, their host down), or that `absent` (`presence.py`) names: they formed
no group with this member. A sender stops waiting for a reducer `absent` names the same way.
Neither costs the all-reduce's deadline.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .channel_pool import ChannelPool
from .plan import GroupPlan
from .reducer import PartReduction

log = logging.getLogger(__name__)

T = TypeVar("T")

# A reducer dials the senders whose stream has not begun this long after its reduction starts,
# and again at this interval; a sender whose connection fails PROBE_FAILURES times in a row is
# gone (killed, its host down): it is dropped from the part at once, not at the deadline. The
# same cadence asks whether a group-mate formed the group at all (`absent`)
PROBE_AFTER_S = 0.5
PROBE_EVERY_S = 0.5
PROBE_FAILURES = 2


async def absent_now(absent: Callable[[], Awaitable[set[str]]] | None) -> set[str]:
    """`absent()`, or nobody when there is none or its DHT read failed (the deadline decides)."""
    if absent is None:
        return set()
    try:
        return await absent()
    except Exception as e:  # noqa: BLE001  (hivemind's DHT reads fail with many types)
        log.debug("reading who formed the group failed: %s", e)
        return set()


class ReducerAbsent(RuntimeError):
    """The reducer of a part formed no group with this member (`absent`): its part is not waited for."""


async def unless_absent(work: Awaitable[T], absent: Callable[[], Awaitable[set[str]]] | None, peer_id: str) -> T:
    """`work`, unless `peer_id` is found absent first (then ReducerAbsent, and `work` is cancelled)."""
    if absent is None:
        return await work
    task = asyncio.ensure_future(work)

    async def until_absent() -> None:
        await asyncio.sleep(PROBE_AFTER_S)
        while peer_id not in await absent_now(absent):
            await asyncio.sleep(PROBE_EVERY_S)

    watcher = asyncio.ensure_future(until_absent())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ReducerAbsent(f"{peer_id} formed no group with this member")
    finally:
        watcher.cancel()


async def drop_senders_gone(
    reduction: PartReduction,
    plan: GroupPlan,
    channels: ChannelPool,
    absent: Callable[[], Awaitable[set[str]]] | None = None,
) -> None:
    """Failure detection faster than a deadline: until every sender's stream has begun (a stream
    that breaks drops its sender by itself), dial the others on their pooled channels, and drop
    those whose connection fails again and again, and those `absent` names (they formed no group
    with this member). A client-mode member (behind NAT, dialled by nobody) that formed the group
    and one still connecting are waited for, up to the deadline."""
    failures: collections.Counter[str] = collections.Counter()
    await asyncio.sleep(PROBE_AFTER_S)
    while not reduction.settled and reduction.failure is None:
        waiting = [
            m
            for m in plan.members
            if m.peer_id in reduction.expected
            and m.peer_id not in reduction.progress
            and m.peer_id not in reduction.failed
        ]
        if not waiting:
            return
        gone = await absent_now(absent)
        for member in waiting:
            if member.peer_id in gone and member.peer_id not in reduction.progress:
                log.warning(
                    "round %s hop %s part %s: sender %s formed no group with this member; dropped from the part",
                    plan.round,
                    plan.hop,
                    reduction.part,
                    member.peer_id,
                )
                await reduction.fail(member.peer_id, absent=True)
        silent = [m for m in waiting if not m.client_mode and m.peer_id not in gone]
        answers = await asyncio.gather(*(channels.dialable(m.grpc_addr, m.peer_id, PROBE_EVERY_S) for m in silent))
        for member, dialled in zip(silent, answers, strict=True):
            failures[member.peer_id] = failures[member.peer_id] + 1 if dialled is False else 0
            if failures[member.peer_id] >= PROBE_FAILURES and member.peer_id not in reduction.progress:
                log.warning(
                    "round %s hop %s part %s: sender %s cannot be reached (%d dials failed); dropped from the part",
                    plan.round,
                    plan.hop,
                    reduction.part,
                    member.peer_id,
                    PROBE_FAILURES,
                )
                await reduction.fail(member.peer_id)
        await asyncio.sleep(PROBE_EVERY_S)
