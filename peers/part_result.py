"""A part's averaged result, held as it arrives (still coded) until the whole part is in and
checked, and only then written over this member's own values there.

The all-reduce may write its results into the very buffer that holds this member's values
(the node's Δ staging buffer is also its mean's: a buffer less on every node; a coded Δ,
ops/coded.py, takes the mean's int8 codes as they came). A
result that fails halfway (its reducer gone, a norm refused) must leave our own values in
place, so nothing of a part is written before its last chunk passed the checks: the chunks
wait coded (int8: about 1 byte per value, sparse: a few percent of that; fp32 results are
their own size), and the checks read them decoded one chunk at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dtnode.ops.coded import CodedSlice
from dtnode.ops.quantization import QuantizedBlocks

from .reducer import decode_into, maybe_thread
from .wire import Payload


@dataclass(frozen=True)
class DriftBound:
    """How far a θ_g re-sync may move this member's state, in L2 over each region of it: θ_g
    (values before `split`), then the outer momentum (`split` more values, or none). Both are
    absolute, derived from this node's own recent outer steps by its caller (daemon/training/outer_replica.py:
    `resync_bound`), never from the norm of θ itself: a bound relative to ‖θ‖ let a member of a
    pair set its partner's θ_g to any T within 4‖θ‖ of it, −θ included.

    Each part of the state, checked where it arrives, gets its share: the bound x sqrt(the part's
    values / the region's) x PART_SLACK. Honest states differ all over (outer steps move every
    value), and parts that each took the whole bound moved the state sqrt(parts) times as far."""

    theta: float
    momentum: float
    split: int

    def allowance(self, region_bound: float, values: int, region_values: int) -> float:
        return PART_SLACK * region_bound * math.sqrt(values / max(region_values, 1))

    def shared(self, apart: int, members: int) -> DriftBound:
        """The bound for a group of `members` in which `apart` others hold another θ_g (at least
        one counts: a member may lie about its hash): each moves a mean by 1/members of the way
        at most, so the mean may move this node's state by apart/members of the bound. A member
        that asked a group of peers of one θ_g for a re-sync and sent values of its own moved
        them all by the whole bound, round after round."""
        fraction = min(max(apart, 1), members) / max(members, 1)
        return DriftBound(self.theta * fraction, self.momentum * fraction, self.split)


PART_SLACK = 2.0  # a part may move up to twice its even share of the bound


class PartResult:
    def __init__(
        self,
        own: torch.Tensor | CodedSlice,
        norm_limit: float | None = None,
        drift: DriftBound | None = None,
        base: int = 0,
    ):
        """`own`: this member's values in the part (read, never written, until `commit`; a
        coded Δ's are decoded a chunk at a time, when a check reads them), which starts at
        `base` in the whole buffer. `norm_limit`: the result may be at most this many times as
        long as `own` (robust mode). `drift`: how far it may move `own` (a re-sync)."""
        self.own = own
        self.norm_limit = norm_limit
        self.drift = drift
        self.base = base
        self._chunks: list[tuple[int, int, Payload]] = []
        self._result_sq = 0.0
        self._moved_sq = [0.0, 0.0]  # in θ_g's region, in the momentum's
        self._values = [0, 0]  # of this part in each region

    async def add(self, offset: int, length: int, payload: Payload) -> None:
        """One chunk of the result at `offset` in the part: kept, and decoded now only if a
        check needs it (in a thread when the chunk is large)."""
        self._chunks.append((offset, length, payload))
        if self.norm_limit is not None or self.drift is not None:
            await maybe_thread(self._measure, offset, length, payload, size=length)

    def _measure(self, offset: int, length: int, payload: Payload) -> None:
        values = torch.empty(length, dtype=torch.float32)
        decode_into(payload, values)
        self._result_sq += float(torch.linalg.vector_norm(values)) ** 2
        if self.drift is not None:
            moved = values - _values(self.own[offset : offset + length])
            cut = min(max(self.drift.split - self.base - offset, 0), length)  # θ_g's values come first
            self._moved_sq[0] += float(torch.linalg.vector_norm(moved[:cut])) ** 2
            self._moved_sq[1] += float(torch.linalg.vector_norm(moved[cut:])) ** 2
            self._values[0] += cut
            self._values[1] += length - cut

    def implausible(self) -> bool:
        """Longer than `norm_limit` x our own values (all zero: nothing to compare with)."""
        if self.norm_limit is None:
            return False
        own_norm = _norm(self.own)
        return own_norm > 0 and math.sqrt(self._result_sq) > self.norm_limit * own_norm

    def drifted(self) -> bool:
        """A mean of nearly equal states (a θ_g re-sync) that moved ours farther than `drift` allows."""
        if self.drift is None:
            return False
        d = self.drift
        theta, momentum = (math.sqrt(moved) for moved in self._moved_sq)
        return not (
            theta <= d.allowance(d.theta, self._values[0], d.split)
            and momentum <= d.allowance(d.momentum, self._values[1], d.split)
        )

    async def commit(self, target: torch.Tensor | CodedSlice) -> None:
        """The checked result into `target` (the part's slice of the output; `own` itself when
        the output is the input), in a thread when the part is large."""
        await maybe_thread(self._write, target, size=target.numel())

    def _write(self, target: torch.Tensor | CodedSlice) -> None:
        for offset, length, payload in self._chunks:
            place = target[offset : offset + length]
            if isinstance(place, CodedSlice):  # an int8 plan's (butterfly_allreduce checks it)
                assert isinstance(payload, QuantizedBlocks)
                place.store(payload)  # the mean's codes as they came: what every member stores
            else:
                decode_into(payload, place)
        self._chunks.clear()


def _values(own: torch.Tensor | CodedSlice) -> torch.Tensor:
    return own.decoded() if isinstance(own, CodedSlice) else own


def _norm(own: torch.Tensor | CodedSlice) -> float:
    return float(own.norm() if isinstance(own, CodedSlice) else torch.linalg.vector_norm(own))
