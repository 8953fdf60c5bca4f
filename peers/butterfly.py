"""Butterfly all-reduce of one flat fp32 buffer over bidirectional gRPC streams (sender side).

The buffer is cut into parts, one per reducer (client-mode members reduce nothing). Each
member streams its slice of part j, int8-quantized chunk by chunk, to reducer j over one
bidirectional stream and reads the averaged chunks back on the same stream while it is
still sending (`part_stream.py`). Quantizing chunk k+1, sending chunk k and reducing chunk
k-1 overlap; a bounded queue per stream keeps at most `in_flight` encoded chunks ahead of the
network. Every member, the reducer included, applies the bytes the reducer returned, so
members that entered with identical buffers leave with identical buffers.

The buffer may be a `CodedDelta` (ops/coded.py: int8 codes, as a node whose θ_g is in host
memory holds Δ): its chunks are sent as the codes they are, and each part's mean is stored
over them as the codes it came back in.

A reducer that fails leaves each sender with its own values for that part. Reducer-side
semantics (validation, chunk-wise finishing) live in `reducer.py`; one run of the all-reduce
is a `ButterflyAllReduce`, as hivemind's is an `AllReduceRunner`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Collection

import torch

from dtnode.ops.coded import CodedDelta, CodedSlice

from .allreduce_report import AllReduceReport, PartOutcome
from .auth import SwarmAuth
from .channel_pool import ChannelPool
from .failure_detector import drop_senders_gone
from .part_codec import Feedback, assign, encode_part, keep_own, sparsify_own, through_int8
from .part_result import DriftBound, PartResult
from .part_stream import PartStream
from .plan import INT8, SPARSE, GroupPlan
from .reducer import PartReduction, ReductionFailed, maybe_thread
from .reduction_registry import ReductionRegistry
from .stand_in import stand_in
from .wire import MAX_WEIGHT, Payload

REDUCER_SHARE = 0.8  # a reducer stops waiting for senders here, leaving the rest to stream the result back
HELD_BACK_GRACE = 0.1  # ...but for senders held back only by slower ones: this share of the timeout more
RESULTS_FLUSH_S = 1.0  # a reducer waits this long for its last result chunks to leave before counting them

# In robust mode a member refuses a part whose averaged result is this many times larger (L2)
# than its own values there: a hostile reducer can then move that part by a bounded amount only.
RESULT_NORM_LIMIT = 4.0


def norm_limit(plan: GroupPlan, own_id: str, robust: bool) -> float | None:
    """How many times the norm of our own values a result may have (None: not checked).

    Robust mode only: RESULT_NORM_LIMIT, more for a member whose Δ weighs less than the group's
    median (fewer steps, a smaller Δ). The plain mean does not check: in warmup a Δ grows faster
    than the steps taken, and a 9-node moshpit swarm refused honest results at 4x even with the
    allowance for weight (own values are no reliable reference there)."""
    if not robust:
        return None
    bound = plan.announced_weight(own_id)
    if bound is None:
        return RESULT_NORM_LIMIT
    median = plan.median_weight
    return RESULT_NORM_LIMIT * max(1.0, median / max(bound[1], 1e-30))


def check_inputs(
    plan: GroupPlan,
    values: torch.Tensor | CodedDelta,
    out: torch.Tensor | CodedDelta,
    weight: float,
    in_flight: int,
    feedback: Feedback | None,
) -> None:
    """ValueError (TypeError for a mix of coded and plain buffers) for inputs the plan cannot average."""
    if values.numel() != plan.numel or out.numel() != plan.numel:
        raise ValueError("buffer size differs from the plan")
    if isinstance(values, CodedDelta) or isinstance(out, CodedDelta):
        # coded values are sent as they are and results stored as they come: the plan's int8
        # blocks must be theirs, and their feedback was taken when they were coded
        if not (isinstance(values, CodedDelta) and isinstance(out, CodedDelta)):
            raise TypeError("a coded Δ is averaged into a coded output")
        if plan.codec != INT8 or {values.block_size, out.block_size} != {plan.block_size} or feedback is not None:
            raise ValueError("a coded Δ travels in the plan's int8 blocks, with no feedback of the wire's")
    if feedback is not None and feedback.buffer.numel() != plan.numel:
        raise ValueError("residual size differs from the plan")
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise ValueError("weight must be finite and positive")
    if in_flight < 1:
        raise ValueError("in_flight must be >= 1")


class ButterflyAllReduce:
    """One member's side of one all-reduce: the part it reduces (`reduce_part`), and its
    slice of every other part streamed to that part's reducer (`PartStream`), all at once.
    See `butterfly_allreduce` for what it promises."""

    def __init__(
        self,
        plan: GroupPlan,
        own_id: str,
        values: torch.Tensor | CodedDelta,
        weight: float,
        out: torch.Tensor | CodedDelta,
        registry: ReductionRegistry,
        channels: ChannelPool,
        timeout: float,
        in_flight: int = 4,
        feedback: Feedback | None = None,
        auth: SwarmAuth | None = None,
        trim_fraction: float | None = None,
        drift: DriftBound | None = None,
        absent: Callable[[Collection[str]], Awaitable[set[str]]] | None = None,
    ):
        check_inputs(plan, values, out, weight, in_flight, feedback)
        self.plan, self.own_id, self.values, self.weight, self.out = plan, own_id, values, weight, out
        self.registry, self.channels, self.timeout, self.in_flight = registry, channels, timeout, in_flight
        self.feedback, self.auth, self.trim_fraction, self.drift = feedback, auth, trim_fraction, drift
        # members known to have formed this group: reducers that took one of our streams
        # (`REDUCING_METADATA`) and senders that began one to our part. A `formed` record read
        # late never makes them absent: a member of a hop-1 group of 8 at 32 nodes was taken
        # for absent by one group-mate while it streamed to the others, and the group's mean
        # lacked two parts' shares
        self.present: set[str] = set()
        # members that answered a stream "not yet, still forming the hop's groups": alive and on
        # their way, so a `formed` record not read yet does not make them absent (only one that
        # names another group does). A late-forming reducer taken for absent by half its hop-1
        # group of 10 while the other half took its mean split θ_g five ways (32 nodes on 2 cores)
        self.forming: set[str] = set()
        self._absent = absent
        self.absent = self._absent_unless_present if absent is not None else None
        self.residual = feedback.buffer if feedback is not None else None
        self.me = plan.index_of(own_id)
        self.limit = norm_limit(plan, own_id, trim_fraction is not None)
        self.report = AllReduceReport(parts=[])
        self.started = time.monotonic()
        # members whose reducer said it formed other groups (NOT_FOUND): they send nothing to our
        # part either, so our reduction stops waiting for them at once instead of at its deadline
        # (where, holding the others' chunks, it would drop them too)
        self.elsewhere: set[str] = set()
        self.own_reduction: PartReduction | None = None
        self.reductions: list[PartReduction] = []  # our own part's, and any we stand in for

    async def run(self) -> AllReduceReport:
        self.started = time.monotonic()
        jobs = [
            self.reduce_part(part) if part == self.me else self.stream_part(part)
            for part, (_, length) in enumerate(self.plan.parts)
            if length > 0
        ]
        self.report.parts = list(await asyncio.gather(*jobs))
        self.report.seconds = time.monotonic() - self.started
        return self.report

    def remaining(self) -> float:
        """Seconds left of the whole all-reduce's timeout."""
        return self.timeout - (time.monotonic() - self.started)

    async def encode(self, values: torch.Tensor | CodedSlice, residual: torch.Tensor | None, size: int) -> Payload:
        """One chunk of this member's values as the wire carries it (a thread for a large one)."""
        return await maybe_thread(encode_part, self.plan, values, residual, self.feedback, size=size)

    async def _absent_unless_present(self) -> set[str]:
        """`absent`'s members, less those this all-reduce has seen in the group (`present`)."""
        assert self._absent is not None
        began = set(self.own_reduction.weights) if self.own_reduction is not None else set()
        return await self._absent(self.forming) - self.present - began

    async def reducer_elsewhere(self, peer_id: str) -> None:
        """A reducer formed other groups: it sends nothing to our part either."""
        self.elsewhere.add(peer_id)
        for reduction in self.reductions:
            await reduction.fail(peer_id, absent=True)

    # ---- a part another member reduces ------------------------------------------------------------
    async def stream_part(self, part: int) -> PartOutcome:
        """Our slice of `part` to its reducer and the checked mean back; where that reducer is
        in no group with anyone, to the part's stand-in, or the stand-in reduces it if that is us
        (stand_in.py). A part no stand-in took keeps our own values, as its first failure said."""
        stream = PartStream(self, part)
        outcome = await stream.outcome()
        if outcome.ok or not outcome.reducer_gone:
            return outcome
        deputy = stand_in(self.plan, part)
        others = set(self.plan.member_ids) - {self.own_id, outcome.reducer}
        instead: PartOutcome | None = None
        if deputy is not None and deputy.peer_id != self.own_id:
            instead = await PartStream(self, part, deputy).outcome()  # keeps our values if it fails
        elif deputy is not None and others:
            instead = await self.reduce_part(part, stand_in_for=outcome.reducer)
        if instead is None:  # nobody to stand in, or nobody to stand in for
            stream.keep_own_values()
            return outcome
        if not instead.ok:
            return outcome
        instead.stood_in_for = outcome.reducer
        return instead

    # ---- the part this member reduces -----------------------------------------------------------
    async def reduce_part(self, part: int, stand_in_for: str | None = None) -> PartOutcome:
        """Reduce a part from every sender's stream, and write its checked mean over our values:
        our own part, or one whose reducer `stand_in_for` is not in the group (stand_in.py)."""
        plan = self.plan
        offset, length = plan.parts[part]
        mine = self.values[offset : offset + length]
        own_residual = self.residual[offset : offset + length] if self.residual is not None else None
        own_before = own_residual.clone() if own_residual is not None and plan.codec == SPARSE else None
        own = await self._own_contribution(mine, own_residual)
        kept = mine if isinstance(mine, CodedSlice) else own  # what a failed reduction leaves in place
        reduction = await maybe_thread(
            PartReduction,
            plan,
            self.own_id,
            own,
            self.weight,
            self.started + self.timeout * REDUCER_SHARE,  # early enough to stream the result back in time
            self.trim_fraction,
            self.timeout * HELD_BACK_GRACE,
            stand_in_for,
            size=length,
        )
        del own  # the reduction holds its own copy: a coded Δ's decoded part goes now
        await self.registry.register(reduction)
        if stand_in_for is None:
            self.own_reduction = reduction
        self.reductions.append(reduction)
        for member in sorted(self.elsewhere):
            await reduction.fail(member, absent=True)
        target = self.out[offset : offset + length]
        watching = asyncio.ensure_future(drop_senders_gone(reduction, plan, self.channels, self.absent))
        try:
            failed = await self._collect(reduction, PartResult(mine, self.limit, self.drift, offset), target)
            if failed is not None:
                if failed.startswith("REDUCTION_FAILED") and plan.codec == SPARSE:
                    keep_own(target, mine, own_residual, own_before, self.feedback)
                else:  # our senders refuse it too: nobody applies it
                    assign(target, kept if failed.startswith("REDUCTION_FAILED") else mine)
                return PartOutcome(part, self.own_id, False, [], 0.0, length, failed)
            try:  # let the last result chunks leave before counting them
                await asyncio.wait_for(reduction.streams_closed.wait(), RESULTS_FLUSH_S)
            except TimeoutError:
                pass
            self.report.bytes_received += reduction.bytes_received
            self.report.bytes_sent += reduction.bytes_sent
            return PartOutcome(part, self.own_id, True, reduction.included, reduction.total_weight, length)
        finally:
            watching.cancel()
            # Keep serving late result requests briefly, then forget the round.
            asyncio.get_running_loop().call_later(self.timeout, self.registry.unregister, reduction)

    async def _own_contribution(
        self, mine: torch.Tensor | CodedSlice, own_residual: torch.Tensor | None
    ) -> torch.Tensor:
        """Our own values as the group sees everyone's: through the same code, or exact."""
        plan, length = self.plan, mine.numel()
        if isinstance(mine, CodedSlice):  # its codes, as the group sees them
            return await maybe_thread(mine.decoded, size=length)
        if plan.codec == SPARSE:
            return await maybe_thread(sparsify_own, plan, mine, own_residual, self.feedback, size=length)
        if plan.codec == INT8 and plan.sums_as_sent:  # as the group sees it
            return await maybe_thread(through_int8, mine, plan.block_size, size=length)
        if own_residual is not None:  # own part is averaged exactly: spend its residual now
            own = mine + own_residual
            own_residual.zero_()
            return own
        return mine

    async def _collect(
        self, reduction: PartReduction, result: PartResult, target: torch.Tensor | CodedSlice
    ) -> str | None:
        """Every chunk of the reduction into `result`, checked and written over `target`; None,
        or why the part failed (the part's values are then left to the caller)."""
        for index, (off, n) in enumerate(reduction.spans):
            try:
                payload = await reduction.wait_chunk(index)
            except ReductionFailed as e:  # logged by the reduction; its senders keep their own values too
                return f"REDUCTION_FAILED: {e}"
            await result.add(off, n, payload)
        if result.drifted():
            return "DRIFTED: the re-synced values moved too far"
        if result.implausible():  # a sender's values were far longer than ours
            return f"IMPLAUSIBLE: the mean is over {self.limit:g}x our norm"
        await result.commit(target)
        return None


async def butterfly_allreduce(
    plan: GroupPlan,
    own_id: str,
    values: torch.Tensor | CodedDelta,
    weight: float,
    out: torch.Tensor | CodedDelta,
    registry: ReductionRegistry,
    channels: ChannelPool,
    timeout: float,
    in_flight: int = 4,
    feedback: Feedback | None = None,
    auth: SwarmAuth | None = None,
    trim_fraction: float | None = None,
    drift: DriftBound | None = None,
    absent: Callable[[Collection[str]], Awaitable[set[str]]] | None = None,
) -> AllReduceReport:
    """Average `values` (flat fp32, CPU) across the plan's members into `out`, which may be
    `values` itself: a part's result is written only once the whole part is in and checked
    (`PartResult`), so the values it replaces are read to the end.

    Parts whose reducer fails keep this member's own values in `out`. With `trim_fraction`,
    the part this member reduces is a coordinate-wise trimmed mean (robust to a minority of
    hostile senders; see ops/robust.py) instead of the weighted mean. With `feedback`
    (error feedback), what the code (int8, or sparse top-k) could not carry of this member's
    parts is added to the next call's values instead of being lost; int8's feedback of parts
    that stay exact is spent. In a sparse plan every member, the reducer of a part included,
    contributes its values through the same top-k code, so the mean is sparse on the union
    of what the members kept.

    Every result is checked before it is kept: the reducer's total weight must be the sum of
    the plan's counted weights of the senders it names (a plan from matchmaking bounds each
    member's weight by its signed registration); its norm must be within `norm_limit` x ours
    (RESULT_NORM_LIMIT, more for a member lighter than the median), the mean of this member's own
    part included; with `drift` (a θ_g re-sync, whose inputs are nearly equal) it may move our
    own values no farther than that bound allows. A result that fails keeps ours: a peer
    sending a Δ far longer than the others' moves nobody, it only costs its groups their average.

    `absent`, when given, names the members known not to be in this group (they formed another,
    or formed none: `peers/presence.py`), less those said to be still forming (its argument):
    this member's reduction stops waiting for their streams, and its streams to their parts
    stop, at once rather than at the deadline.
    """
    run = ButterflyAllReduce(
        plan,
        own_id,
        values,
        weight,
        out,
        registry,
        channels,
        timeout,
        in_flight,
        feedback,
        auth,
        trim_fraction,
        drift,
        absent,
    )
    return await run.run()
