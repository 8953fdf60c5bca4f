"""The reductions this node serves as a reducer, keyed by what a chunk names (run, round, hop,
group, part): where the averaging service finds the `PartReduction` a sender's stream feeds,
waits for one whose group has not formed here yet, and learns that one never will.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .reducer import PartReduction


@dataclass
class _HopGroups:
    """The groups this node formed in one hop of a round: once every slot of the hop (a peer
    alone in one hop stands in two classes of the next) has its group, a plan that is not
    among them is one this node will never reduce for."""

    slots: int
    settled: int = 0
    group_ids: set[bytes] = field(default_factory=set)


class ReductionRegistry:
    """The reductions this node currently serves, keyed by what a chunk names."""

    KEPT_ROUNDS = 3  # hops of rounds this far behind the newest are forgotten

    def __init__(self) -> None:
        self._reductions: dict[tuple, PartReduction] = {}
        # set, and replaced by a fresh one, whenever a reduction registers: a waiter holds no lock
        # (with an asyncio.Condition, a lookup cancelled while its timed-out wait re-took the lock
        # left `async with` releasing a lock it did not hold: RuntimeError in the gRPC handler,
        # seen on a loaded 32-node swarm when a sender's stream was cut at its deadline)
        self._changed = asyncio.Event()
        self._hops: dict[tuple[str, int, int], _HopGroups] = {}

    def hop_begins(self, run_id: str, round: int, hop: int, slots: int) -> None:
        """This node forms `slots` groups in this hop of Δ's averaging (see `elsewhere`)."""
        self._hops = {k: v for k, v in self._hops.items() if k[0] == run_id and k[1] > round - self.KEPT_ROUNDS}
        self._hops[(run_id, round, hop)] = _HopGroups(slots)

    def slot_settled(self, run_id: str, round: int, hop: int, group_id: bytes | None) -> None:
        """One slot of the hop has its group: the plan's id, or None for a group of one."""
        groups = self._hops.get((run_id, round, hop))
        if groups is not None:
            groups.settled += 1
            if group_id is not None:
                groups.group_ids.add(bytes(group_id))

    def may_come(self, run_id: str, round: int) -> bool:
        """Whether a reduction of `round` may still register here: a round this node is in,
        about to enter, or has just left (a stream for a round far ahead is nobody's yet)."""
        newest = max((r for (run, r, _) in self._hops if run == run_id), default=None)
        return newest is None or round <= newest + 1

    def forming(self, key: tuple) -> bool:
        """Whether this node is still forming its groups of the key's hop (or is in a hop before
        it, of the same round): its group may yet be the sender's. A member that says so is
        alive and on its way, whatever its `formed` record (not yet written) says."""
        run_id, round, hop, _, _ = key
        groups = self._hops.get((run_id, round, hop))
        if groups is not None:
            return groups.settled < groups.slots
        return any(run == run_id and r == round and h < hop for (run, r, h) in self._hops)

    def elsewhere(self, key: tuple) -> bool:
        """Whether a sender's plan names a group this node is not in: every slot of that hop
        has its group here, and none is the plan's. Its view of the group differed from ours
        (a member it counted in left our view, or the grid's cells fell otherwise), so its
        members must not wait for this node's slices until their deadline."""
        run_id, round, hop, group_id, _ = key
        groups = self._hops.get((run_id, round, hop))
        return groups is not None and groups.settled >= groups.slots and bytes(group_id) not in groups.group_ids

    @staticmethod
    def key(run_id: str, round: int, hop: int, group_id: bytes, part: int) -> tuple:
        return (run_id, round, hop, bytes(group_id), part)

    async def register(self, reduction: PartReduction) -> None:
        plan = reduction.plan
        reduction.start()
        self._reductions[self.key(plan.run_id, plan.round, plan.hop, plan.group_id, reduction.part)] = reduction
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def unregister(self, reduction: PartReduction) -> None:
        plan = reduction.plan
        reduction.stop()
        self._reductions.pop(self.key(plan.run_id, plan.round, plan.hop, plan.group_id, reduction.part), None)

    async def lookup(self, key: tuple, wait: float) -> PartReduction | None:
        """A sender may reach us before we formed the same group: wait for it, boundedly."""
        try:
            async with asyncio.timeout(wait):
                while key not in self._reductions:
                    await self._changed.wait()
        except TimeoutError:
            return None
        return self._reductions[key]
