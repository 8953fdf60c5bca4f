"""Which members of a formed group are not in it, learnt from their `formed` records.

Every member publishes the group it formed once it settled (matchmaking.py), a moment before
its first stream leaves. A member whose record names another group is elsewhere; one that has
published none while most of the group published theirs a lag ago (or, in a pair, for a grace
past this node's own) formed no group at all: it registered and went silent (a hostile member, or a
node hung between registering and streaming). Its group-mates stop waiting for its streams and
stop asking it for its part (butterfly.py) at once: a dead member is found by dialling it, an
absent live one by its missing record, and neither costs the all-reduce's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Mapping

# past the moment most of the group had published theirs: at least this, and more when this node's
# DHT reads are slow (`Matchmaker.formed_lag`): a follower reads its leader's list a poll later
# than another, and a present member taken for absent splits its group's θ_g (a loaded 9-node
# swarm's reads lagged a member's record by a second)
FORMED_LAG_S = 0.5
FORMED_GRACE_S = 3.0  # with no majority to compare with (a pair), past this node's own (plus the lag's excess)
READ_REUSE_S = 0.25  # one DHT read of the records serves every part's probe meanwhile


class GroupPresence:
    def __init__(
        self,
        members: Collection[str],
        own_id: str,
        read_formed: Callable[[], Awaitable[dict[str, tuple[str, ...]]]],
        clock: Callable[[], float] = time.monotonic,
        lag: float = FORMED_LAG_S,
        loads: Mapping[str, int] | None = None,
    ):
        self.members = frozenset(members)
        self.others = self.members - {own_id}
        self.read_formed = read_formed
        self.clock = clock
        self.lag = max(lag, FORMED_LAG_S)
        self.grace = FORMED_GRACE_S + self.lag - FORMED_LAG_S
        # the groups each member said it stands in this hop (its registration's `load`): one that
        # forms k groups at once registers, polls and publishes k times, and its records come up
        # to k lags later (a member of 2 groups taken for absent by one group-mate split a hop-1
        # group of 9 at 32 nodes on 2 cores)
        self.loads = dict(loads or {})
        self.started = clock()  # this node published its own record just before
        self._majority_at: float | None = None
        self._read_at = -1.0
        self._elsewhere: set[str] = set()
        self._missing: set[str] = set()

    async def absent(self, forming: Collection[str] = ()) -> set[str]:
        """The members known not to be in this group now (see the module). `forming`: members
        that said they are still forming their groups of the hop (`ReductionRegistry.forming`):
        alive and on their way, they are absent only where their record names another group."""
        now = self.clock()
        if now - self._read_at >= READ_REUSE_S:
            await self._read(now)
        return self._elsewhere | (self._missing - set(forming))

    async def _read(self, now: float) -> None:
        self._read_at = now
        formed = await self.read_formed()
        mine = {p for p in self.others if p in formed and set(formed[p]) == self.members}
        elsewhere = {p for p in self.others if p in formed and set(formed[p]) != self.members}
        if self._majority_at is None and 2 * len(mine) >= len(self.others) and len(self.others) > 1:
            self._majority_at = now
        self._missing = {p for p in self.others - mine - elsewhere if self._lapsed(p, now)}
        self._elsewhere = elsewhere

    def _lapsed(self, member: str, now: float) -> bool:
        """Whether a member without a record has let its time for one pass (see the module)."""
        extra = self.lag * (max(self.loads.get(member, 1), 1) - 1)
        after_majority = self._majority_at is not None and now - self._majority_at > self.lag + extra
        return after_majority or now - self.started > self.grace + extra
