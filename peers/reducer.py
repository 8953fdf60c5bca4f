"""Reducer side of the butterfly: one fp32 accumulator per part, finished chunk by chunk.

Memory stays bounded: a reducer holds its fp32 accumulator, the int8 result it returns and,
per sender stream, the chunks that wait for the others' (at most 4 per sender: the mean of a
chunk is taken once all its contributions are in, see `PartReduction`); it never keeps a copy
of any sender's whole part.
Chunk k of the result is final as soon as every sender still in the group has delivered
chunk k (or has failed), and it streams back to every sender at once, so sending, reducing
and returning overlap across the whole part instead of running one after the other.

A sender that fails mid-stream therefore counts in the chunks it delivered in full and not
in the rest: each chunk is the weighted mean of the senders that delivered it, which is the
price of not holding every sender's part for a rollback. Every member still receives the
same bytes for every chunk.

In the plain mean, each contribution to a chunk is first held to CLIP_REACH x the lower median
of the chunk's contribution lengths (ops/robust.py): the reducer does it for the whole group,
so one member's outsized Δ moves every member's result alike, by a bounded amount, and honest
members keep one θ_g.

A chunk of the mean that cannot be finished (its sum overflowed, or the reducer's own values
were not finite) fails the whole part at once: every member keeps its own values there, as
for a reducer that died, instead of waiting for a chunk that never comes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import torch

from dtnode.ops import sparse
from dtnode.ops.ordered_mean import ordered_weighted_mean, sum_weights
from dtnode.ops.quantization import (
    NonFiniteError,
    QuantizedBlocks,
    dequantize,
    num_blocks,
    quantize,
)
from dtnode.ops.robust import CLIP_REACH, clip_to_median, trim_count, trimmed_mean

from . import failpoints
from .plan import FP32, SPARSE, GroupPlan, chunk_spans
from .wire import (
    MAX_WEIGHT,
    WEIGHT_SLACK,
    ChunkError,
    Payload,
    RefusalReason,
    numel_of,
    slice_payload,
)

log = logging.getLogger(__name__)

# Tensor work on chunks smaller than this stays on the event loop: a thread hop costs more.
THREAD_THRESHOLD = 1 << 16

# The largest |value x weight| one sender may add to the sum (a Δ is ~1e-2, a weight a token
# count). Finite int8 scales of 3e38 or weights of 1e12 pass every other check, yet their sum
# overflows fp32: one such sender would make the whole part's mean infinite. With this bound,
# a few hundred senders still sum below fp32's 3.4e38.
MAX_CONTRIBUTION = 1e36
# A sender runs at most this many chunks ahead of the mean's last final chunk: what a part
# holds of each sender stays bounded however far apart the senders stream.
AHEAD_CHUNKS = 4


class ReductionFailed(RuntimeError):
    """This part's mean could not be finished: every member keeps its own values for it."""


class SenderAbsent(ChunkError):
    """This member took the sender for out of the group (its `formed` record named another
    group, or none in time) and left it out of its part: the sender is answered NOT_FOUND, as by
    a member that formed other groups, and leaves this member out of its own part at once.

    Presence is read from the DHT, and a loaded host's reads lag: one member of a group of 4
    took another for absent and stopped streaming to it, while that one, which read every
    record, waited 48 s for its stream to the deadline and came late to every group of the next
    hop (32 nodes on 2 cores). Telling it makes the mistake cost one pair's two parts, at once."""

    def __init__(self, sender: str):
        super().__init__(f"sender {sender} is not in this member's group: its record named another group, or none")


class SenderLate(ChunkError):
    """The sender was dropped from this part: it came after the reducer's deadline, or an
    earlier stream of its failed. Nothing more of it is counted, but it is a member of the group
    and still takes the part's mean, streamed back on the same stream (`AveragingService`).

    Told to go, it kept its own values there while its group-mates took the mean: it carried
    another value of the part into the next hop, and the grid's last-hop groups ended on
    different θ_g though each was complete (32 nodes on 2 cores, a load average near 50: most
    split rounds). Taking the mean without its values, it leaves with its group-mates' bytes;
    what it loses is its share of that part for one round, as a member that missed the group."""

    def __init__(self, sender: str):
        super().__init__(
            f"sender {sender} was dropped from this part (it came after the deadline, or an earlier stream of "
            "its failed): it takes the part's mean without its values"
        )


def largest_magnitude(payload: Payload) -> float:
    """An upper bound of |value| over the payload (int8 codes decode within 128 scales)."""
    if numel_of(payload) == 0:
        return 0.0
    if isinstance(payload, QuantizedBlocks):
        return float(payload.scales.max()) * 128 if payload.scales.numel() else 0.0
    if isinstance(payload, sparse.SparseBlocks):
        levels = 1.0 if payload.value_bits == sparse.TWO_BIT else 128.0
        return float(payload.scales.max()) * levels if payload.scales.numel() else 0.0
    return float(payload.abs().max())


def decode_payload(payload: Payload) -> torch.Tensor:
    """A payload as dense fp32 values (a new tensor)."""
    values = torch.empty(numel_of(payload))
    decode_into(payload, values)
    return values


def decode_into(payload: Payload, target: torch.Tensor) -> None:
    """A payload's dense fp32 values, written into `target` (of its length)."""
    if isinstance(payload, QuantizedBlocks):
        dequantize(payload, out=target)
    elif isinstance(payload, sparse.SparseBlocks):
        sparse.decode(payload, out=target)
    else:
        target.copy_(payload)


def clipped_mean_into(
    own: torch.Tensor, own_weight: float, held: list[tuple[Payload, float]], plan: GroupPlan, own_counts: bool = True
) -> int:
    """own ← the weighted mean of `own` and the senders' chunks, each first held (where the plan
    says `clip_lengths`) to CLIP_REACH x the lower median of their lengths (`clip_to_median`);
    returns how many contributions were scaled down. Where two groups may reduce the same
    contributions (`plan.sums_as_sent`) they are added in a fixed order (`ordered_weighted_mean`),
    elsewhere (int8's hop 0, where no two groups share one) in one matrix product. Sparse chunks
    are laid out on their union support only: the sort and the sums touch the few positions
    someone kept, not the whole chunk. `own_counts` False: `own` only takes the senders' mean
    (this reducer is `silent` in the plan; `held` is not empty then)."""
    weights = [own_weight, *(w for _, w in held)]
    first = 0 if own_counts else 1
    kept = [(sparse.positions(p), sparse.values_of(p)) for p, _ in held if isinstance(p, sparse.SparseBlocks)]
    if held and len(kept) == len(held):
        support = torch.cat([own.nonzero().squeeze(1), *(at for at, _ in kept)]).unique()
        rows = torch.zeros(len(weights), support.numel())
        rows[0] = own[support]
        for row, (at, values) in zip(rows[1:], kept, strict=True):
            row[torch.searchsorted(support, at)] = values
        rows, weights = rows[first:], weights[first:]
        scaled = clip_to_median(rows) if plan.clip_lengths else 0
        own.zero_()
        own[support] = ordered_weighted_mean(rows, weights, out=torch.empty(support.numel()), mostly_zero=True)
        return scaled
    rows = torch.empty(len(weights), own.numel())
    rows[0].copy_(own)
    for row, (payload, _) in zip(rows[1:], held, strict=True):
        decode_into(payload, row)
    rows, weights = rows[first:], weights[first:]
    scaled = clip_to_median(rows) if plan.clip_lengths else 0
    if plan.sums_as_sent:
        ordered_weighted_mean(rows, weights, out=own)
    else:
        torch.mv(rows.t(), torch.tensor(weights, dtype=torch.float32), out=own).div_(sum_weights(weights))
    return scaled


async def maybe_thread(fn: Callable, *args, size: int):
    if size >= THREAD_THRESHOLD:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class PartReduction:
    """One part of one group round: accumulator, per-chunk weights, and who delivered what."""

    def __init__(
        self,
        plan: GroupPlan,
        own_id: str,
        own_values: torch.Tensor,
        own_weight: float,
        deadline: float,
        trim_fraction: float | None = None,
        grace: float = 0.0,
        stand_in_for: str | None = None,
    ):
        """`deadline`: when senders that have not finished are dropped (`monotonic`), but for
        those held back only by the chunks of dropped ones (`AHEAD_CHUNKS`): they get `grace`
        seconds more. `stand_in_for`: the part is that member's, and it is not in the group
        (peers/stand_in.py); otherwise the part is this member's own."""
        self.plan = plan
        self.part = plan.index_of(stand_in_for or own_id)
        self.offset, self.length = plan.parts[self.part]
        self.spans = chunk_spans(plan, self.part)
        self.own_id = own_id
        self.deadline = deadline
        self.grace = grace
        # Each sender's chunk is kept as it came until the chunk is final (`held`, a few chunks
        # per sender at most, see `add`). Robust mode then takes a trimmed mean of their decoded
        # values instead of the weighted sum. In the plain mean each contribution is clipped
        # against the others' lengths (`clipped_mean_into`), then they are added in an order of
        # their own values (`ordered_weighted_mean`): two moshpit groups that reduce the same
        # contributions (a peer alone in one hop stands in two classes of the next) then return
        # the same bits, whoever reduces and whatever arrives first.
        self.trim_fraction = trim_fraction
        self.held: dict[int, list[tuple[Payload, float]]] = {}  # the mean: chunk -> (payload, weight) per sender
        # the same for the plan's `silent` senders, whose values count only in a chunk that no
        # other contribution reached
        self.unheard: dict[int, list[tuple[Payload, float]]] = {}
        bound = plan.announced_weight(own_id)  # the reducer's own weight is bounded like a sender's
        own_weight = float(own_weight) if bound is None else min(float(own_weight), bound[1])
        self.own_weight = own_weight
        self.accumulator = own_values.to(torch.float32, copy=True)
        self.clipped = 0  # contributions to a chunk scaled down to the plain mean's bound
        self.expected = {m.peer_id for m in plan.members} - {own_id} - ({stand_in_for} if stand_in_for else set())
        self.weights: dict[str, float] = {}
        self.progress: dict[str, int] = {}  # chunks folded in, per sender
        self.committed: list[str] = []
        self.failed: set[str] = set()
        self.held_back: set[str] = set()  # senders whose next chunk waits for the mean (`AHEAD_CHUNKS`)
        # senders this member took for absent (their records name another group, or none): they
        # are told so if they stream (`SenderAbsent`), and stop waiting for this member's stream
        self.absent: set[str] = set()
        self.finalized = 0  # chunks of the result that are final
        # a sparse mean is returned chunk by chunk on its support, encoded when final
        self.sparse_results: dict[int, sparse.SparseBlocks] = {}
        if plan.codec in (FP32, SPARSE):
            self.result: QuantizedBlocks | torch.Tensor = self.accumulator
        else:
            self.result = QuantizedBlocks(
                torch.empty(self.length, dtype=torch.int8),
                torch.empty(num_blocks(self.length, plan.block_size)),
                plan.block_size,
            )
        self.bytes_received = 0
        self.bytes_sent = 0  # result chunks streamed back to senders
        self.open_streams = 0
        self.streams_closed = asyncio.Event()
        self.streams_closed.set()
        self._chunk_locks = [asyncio.Lock() for _ in self.spans]
        self._advance_lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._watchdog: asyncio.Task | None = None
        self.failure: ReductionFailed | None = None

    @property
    def settled(self) -> bool:
        return self.finalized == len(self.spans)

    def start(self) -> None:
        """Arm the deadline: senders that have not finished by then are dropped."""
        if self._watchdog is None and not self.settled:
            self._watchdog = asyncio.ensure_future(self._expire_at_deadline())
        if not self.expected:
            asyncio.ensure_future(self._advance())

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _late(self) -> set[str]:
        return self.expected - self.failed - set(self.committed)

    async def _expire_at_deadline(self) -> None:
        """At the deadline, drop the senders that have not finished, but for those held back
        only by the others' chunks (`held_back`: at most AHEAD_CHUNKS ahead of the mean): the
        chunks they wait for finish once the ones behind are dropped, and they get `grace` to
        send the rest. Dropped with the rest, a sender that was ahead of a slow one lost the part,
        and, where every other sender was ahead, the mean was the reducer's own values (a part
        of more than AHEAD_CHUNKS chunks: a large model's)."""
        await asyncio.sleep(max(self.deadline - time.monotonic(), 0))
        late = self._late()
        ahead = late & self.held_back
        await self._drop_late(late - ahead, "by the deadline")
        if ahead and self._late():
            await asyncio.sleep(self.grace)
            await self._drop_late(self._late(), f"by the deadline and {self.grace:.1f}s of grace")

    async def _drop_late(self, late: set[str], when: str) -> None:
        if not late:
            return
        log.warning(
            "round %s hop %s part %s: no complete stream from %s %s",
            self.plan.round,
            self.plan.hop,
            self.part,
            sorted(late),
            when,
        )
        for sender in sorted(late):
            await self.fail(sender)

    def begin(self, sender: str, weight: float) -> None:
        if sender not in self.expected:
            raise ChunkError(f"sender {sender} is not a member of this group")
        if sender in self.absent:
            raise SenderAbsent(sender)
        if sender in self.failed:
            raise SenderLate(sender)
        if sender in self.progress:
            raise ChunkError(f"sender {sender} already streamed this part")
        if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
            raise ChunkError(f"weight {weight} out of range", RefusalReason.BAD_WEIGHT)
        if (bound := self.plan.announced_weight(sender)) is not None:
            announced, counted = bound
            if weight > announced * (1 + WEIGHT_SLACK):
                raise ChunkError(
                    f"weight {weight:g} is above the {announced:g} its registration announced", RefusalReason.BAD_WEIGHT
                )
            weight = min(weight, counted)  # what the plan lets it count: every member knows it
        if time.monotonic() > self.deadline:
            raise SenderLate(sender)
        self.weights[sender] = weight
        self.progress[sender] = 0

    async def add(self, sender: str, index: int, payload: Payload) -> None:
        """Fold chunk `index` of a sender into the accumulator (chunks arrive in order)."""
        async with self._changed:  # bounded buffering: a sender runs at most AHEAD_CHUNKS ahead
            self.held_back.add(sender)
            try:
                await self._changed.wait_for(
                    lambda: index < self.finalized + AHEAD_CHUNKS or sender in self.failed or self.failure is not None
                )
            finally:
                self.held_back.discard(sender)
        async with self._chunk_locks[index]:
            if self.failure is not None:
                raise ChunkError(str(self.failure))
            if sender in self.absent:
                raise SenderAbsent(sender)
            if sender in self.failed:
                raise SenderLate(sender)
            await maybe_thread(self._fold, index, sender, payload, self.weights[sender], size=numel_of(payload))
            # A held chunk counts even if the sender was dropped meanwhile: it is in the sum.
            self.progress[sender] = index + 1
        failpoints.reach("reducing", self.plan.round)
        if sender in self.failed:
            raise SenderLate(sender)
        if index + 1 == len(self.spans):
            self.committed.append(sender)
        await self._advance()

    def _fold(self, index: int, sender: str, payload: Payload, weight: float) -> None:
        if not largest_magnitude(payload) * weight <= MAX_CONTRIBUTION:
            raise ChunkError(f"values x weight exceed {MAX_CONTRIBUTION:g}: the sum would overflow")
        held = self.held if self.plan.counts(sender) else self.unheard
        held.setdefault(index, []).append((payload, weight))

    async def fail(self, sender: str, absent: bool = False) -> None:
        """Drop a sender from every chunk it has not delivered in full; `absent`: because this
        member takes it for out of the group (see `SenderAbsent`)."""
        if sender not in self.expected or sender in self.committed:
            return
        if absent:
            self.absent.add(sender)
        if sender in self.failed:
            return
        self.failed.add(sender)
        if self.progress.get(sender, 0):
            log.info(
                "round %s part %s: sender %s counted in %d of %d chunks",
                self.plan.round,
                self.part,
                sender,
                self.progress[sender],
                len(self.spans),
            )
        await self._advance()

    def _ready(self, index: int) -> bool:
        return all(s in self.failed or self.progress.get(s, 0) > index for s in self.expected)

    async def _advance(self) -> None:
        async with self._advance_lock:
            while not self.settled and self.failure is None and self._ready(self.finalized):
                index = self.finalized
                offset, length = self.spans[index]
                async with self._chunk_locks[index]:  # a fold in flight completes first
                    try:
                        await maybe_thread(self._finish_chunk, index, offset, length, size=length)
                    except Exception as e:  # nobody is to blame in the stream that got here first
                        self.failure = ReductionFailed(f"chunk {index} of the mean cannot be finished: {e!r}")
                        log.log(
                            logging.WARNING if isinstance(e, NonFiniteError) else logging.ERROR,
                            "round %s hop %s part %s: %s; every member keeps its own values",
                            self.plan.round,
                            self.plan.hop,
                            self.part,
                            self.failure,
                            exc_info=None if isinstance(e, NonFiniteError) else e,
                        )
                    else:
                        self.finalized += 1
                async with self._changed:
                    self._changed.notify_all()
        if self.settled or self.failure is not None:
            self.stop()
            if self.clipped:  # honest too, where step counts differ much (a warm-up, a joiner)
                log.info(
                    "round %s hop %s part %s: %d contributions to its chunks were longer than %g x the "
                    "chunk's lower median: scaled down to that",
                    self.plan.round,
                    self.plan.hop,
                    self.part,
                    self.clipped,
                    CLIP_REACH,
                )
                self.clipped = 0

    def _contributions(self, index: int) -> tuple[list[tuple[Payload, float]], bool]:
        """The senders' contributions to chunk `index` that enter its mean, and whether this
        reducer's own does: all but the plan's `silent` ones, unless none but those reached it."""
        held, unheard = self.held.pop(index, []), self.unheard.pop(index, [])
        own_counts = self.plan.counts(self.own_id)
        if not own_counts and not held:
            return held + unheard, True
        return held, own_counts

    def _finish_chunk(self, index: int, offset: int, length: int) -> None:
        mean = self.accumulator[offset : offset + length]
        held, own_counts = self._contributions(index)
        if self.trim_fraction is None:
            self.clipped += clipped_mean_into(mean, self.own_weight, held, self.plan, own_counts)
        else:
            rows = ([(mean, self.own_weight)] if own_counts else []) + [(decode_payload(p), w) for p, w in held]
            stacked = torch.stack([values for values, _ in rows])
            weights = torch.tensor([w for _, w in rows], dtype=torch.float64)
            trimmed_mean(stacked, trim_count(stacked.shape[0], self.trim_fraction), out=mean, weights=weights)
        if self.plan.codec == SPARSE:
            self.sparse_results[index] = sparse.encode_support(mean, self.plan.block_size)
        elif isinstance(self.result, QuantizedBlocks):
            quantize(mean, self.plan.block_size, out=slice_payload(self.result, offset, length, self.plan.block_size))

    async def wait_chunk(self, index: int) -> Payload:
        """Chunk `index` of the result, once final; raises ReductionFailed if it never will be."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.finalized > index or self.failure is not None)
        if self.finalized <= index:
            assert self.failure is not None  # the wait ends on a final chunk or a failure
            raise self.failure
        if self.plan.codec == SPARSE:
            return self.sparse_results[index]
        offset, length = self.spans[index]
        return slice_payload(self.result, offset, length, self.plan.block_size)

    @property
    def included(self) -> list[str]:
        """Senders counted in every chunk, this reducer included."""
        return sorted([self.own_id, *self.committed])

    @property
    def total_weight(self) -> float:
        """The senders' weights summed correctly rounded: the same bits in any arrival order,
        and for a weight that came split among several senders (`ordered_mean`)."""
        return sum_weights([self.own_weight, *(self.weights[s] for s in self.committed)])
