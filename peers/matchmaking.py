"""Group formation through the DHT, without a leader.

Every peer that reaches hop k of round r registers under the key
`{run_id}.group.{r}.{k}.{cell}` (the cell is its moshpit grid coordinates without dimension
k, see `grid.py`) and polls it. The group closes when every peer it expects there has
registered, when it reaches the target size, or when the matchmaking window ends. Every member then derives the
same groups from the same sorted registrant list (split into balanced groups when over
the target size).

Views can still differ (a registration that reached one member before it closed and another
after), so closing has a second phase: each member publishes the member list it closed with
and waits, briefly, for the lists of its group. A latecomer ignores registrants that already
closed without it; a member that sees a list different from its own averages alone for this
hop. A divergent view therefore costs its members one hop of averaging, never a stall until
the all-reduce timeout and never a corrupted average (reducers also reject chunks whose
group id differs from theirs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .auth import AuthError, SwarmAuth
from .grid import split_groups
from .plan import Member

log = logging.getLogger(__name__)


class Registration(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    grpc_addr: str = Field("", max_length=256)
    client_mode: bool = False
    bandwidth_mbps: float = Field(1000.0, gt=0, le=1e9)
    resync: bool = False  # asks the group to also average θ_g this hop (after a failure, a join)
    auth: str = Field("", max_length=512)


MAX_REGISTRANTS = 4096  # per group key: a flood of fake registrations stays bounded

@dataclass
class FormedGroup:
    key: str
    members: list[Member]
    registrants: int
    seconds: float
    complete: bool = False  # every expected member registered before the window ended
    last_arrival_lag: float = 0.0  # seconds from our registration to the last registrant's
    resync: bool = False  # some member asked the group to average θ_g too (all members see the same)


class Matchmaker:
    def __init__(self, dht: hivemind.DHT, run_id: str, own: Member, poll_interval: float = 0.15,
                 auth: SwarmAuth | None = None):
        self.dht = dht
        self.run_id = run_id
        self.own = own
        self.poll_interval = poll_interval
        self.auth = auth

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

    async def _registrations(self, key: str) -> dict[str, tuple[Member, bool]]:
        found = await self.dht.get(key, latest=True, return_future=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        members = {}
        for peer_id, item in list(entries.items())[:MAX_REGISTRANTS]:
            try:
                reg = Registration.model_validate(item.value)
            except (ValidationError, AttributeError, TypeError):
                continue
            if not isinstance(peer_id, str) or len(peer_id) > 128 or (not reg.client_mode and not reg.grpc_addr):
                continue
            if not self._authentic("register", f"{key}|{reg.grpc_addr}|{reg.client_mode}", reg.auth, peer_id):
                continue  # without the swarm key nobody joins our groups
            members[peer_id] = (Member(peer_id, reg.grpc_addr, reg.client_mode, reg.bandwidth_mbps), reg.resync)
        return members

    async def _closed_lists(self, key: str) -> dict[str, tuple[str, ...]]:
        found = await self.dht.get(key + ".closed", latest=True, return_future=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        lists = {}
        for peer_id, item in list(entries.items())[:MAX_REGISTRANTS]:
            value = getattr(item, "value", None)
            members = value.get("members") if isinstance(value, dict) else None
            if isinstance(peer_id, str) and isinstance(members, (list, tuple)) and len(members) <= 4096 \
                    and all(isinstance(v, str) and len(v) <= 128 for v in members) \
                    and self._authentic("closed", f"{key}|{','.join(members)}", str(value.get("auth", "")), peer_id):
                lists[peer_id] = tuple(members)
        return lists

    async def form_group(self, round: int, hop: int, expected: Callable[[], Awaitable[set[str]]], window: float,
                         target_size: int, confirm_timeout: float = 3.0, cell: str = "all",
                         resync: bool = False,
                         admitted: Callable[[], Awaitable[set[str]]] | None = None) -> FormedGroup:
        """Register for (round, hop, grid cell) and return this peer's group once it closes.

        `expected` names the peers this one should meet there; the group closes as soon as
        they have all registered, or when the window ends. `admitted`, when given, names
        every peer that may be grouped with this one at all (the swarm's signed membership):
        anyone can write a registration under any id, so without it a flood of made-up
        registrants would each get a part of the all-reduce and fail it.
        """
        started = time.monotonic()
        key = self.group_key(round, hop, cell)
        tag = self.auth.issue("register", f"{key}|{self.own.grpc_addr}|{self.own.client_mode}") if self.auth else ""
        value = Registration(grpc_addr=self.own.grpc_addr, client_mode=self.own.client_mode,
                             bandwidth_mbps=self.own.bandwidth, resync=resync, auth=tag).model_dump()
        await self.dht.store(key, subkey=self.own.peer_id, value=value,
                             expiration_time=get_dht_time() + window + 60, return_future=True)
        deadline = started + window
        registrants: dict[str, Member] = {self.own.peer_id: self.own}
        flags: dict[str, bool] = {self.own.peer_id: resync}
        me = self.own.peer_id
        last_arrival = started
        complete = False
        while True:
            try:
                closed = await self._closed_lists(key)
                registrations = await self._registrations(key)
                flags = {p: flag for p, (_, flag) in registrations.items()} | {me: resync}
                allowed = await admitted() if admitted is not None else None
                found = {p: m for p, (m, _) in registrations.items()
                         if (p not in closed or me in closed[p]) and (allowed is None or p in allowed)} | {me: self.own}
                if set(found) - set(registrants):
                    last_arrival = time.monotonic()
                registrants = found
                wanted = await expected()
            except Exception as e:
                log.warning("matchmaking lookup failed: %s", e)
                wanted = set(registrants) | {"?"}
            complete = wanted <= set(registrants)
            if complete or time.monotonic() >= deadline:
                break
            await asyncio.sleep(self.poll_interval)
        groups = split_groups(list(registrants), target_size)
        mine = tuple(next(g for g in groups if me in g))
        members = [registrants[p] for p in mine]
        if len(mine) > 1:
            members = await self._confirm(key, mine, members, confirm_timeout)
        if all(m.client_mode for m in members):
            members = [self.own]  # nobody can reduce: average alone
        wanted_resync = any(flags.get(m.peer_id, False) for m in members)
        return FormedGroup(key, members, len(registrants), time.monotonic() - started, complete,
                           last_arrival - started, wanted_resync)

    async def _confirm(self, key: str, mine: tuple[str, ...], members: list[Member], timeout: float) -> list[Member]:
        """Second phase: proceed only if no member of the group closed with another list."""
        tag = self.auth.issue("closed", f"{key}|{','.join(mine)}") if self.auth else ""
        await self.dht.store(key + ".closed", subkey=self.own.peer_id, value={"members": list(mine), "auth": tag},
                             expiration_time=get_dht_time() + 120, return_future=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                closed = await self._closed_lists(key)
            except Exception as e:
                log.warning("matchmaking confirmation failed: %s", e)
                return [self.own]
            if all(p in closed for p in mine) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(self.poll_interval)
        divergent = sorted(p for p in mine if p in closed and closed[p] != mine)
        if divergent:
            log.warning("%s: %s closed with another member list; averaging alone this hop", key, divergent)
            return [self.own]
        # A member that never confirmed (crashed) stays in: the all-reduce drops its parts.
        return members
