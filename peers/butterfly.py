"""Butterfly all-reduce of one flat fp32 buffer over bidirectional gRPC streams (sender side).

The buffer is cut into parts, one per reducer (client-mode members reduce nothing). Each
member streams its slice of part j, int8-quantized chunk by chunk, to reducer j over one
bidirectional stream and reads the averaged chunks back on the same stream while it is
still sending. Quantizing chunk k+1, sending chunk k and reducing chunk k-1 overlap; a
bounded queue per stream keeps at most `in_flight` encoded chunks ahead of the network.
Every member, the reducer included, applies the bytes the reducer returned, so members
that entered with identical buffers leave with identical buffers.

The buffer may be a `CodedDelta` (ops/coded.py: int8 codes, as a node whose θ_g is in host
memory holds Δ): its chunks are sent as the codes they are, and each part's mean is stored
over them as the codes it came back in.

A reducer that fails leaves each sender with its own values for that part. Reducer-side
semantics (validation, chunk-wise finishing) live in `reducer.py`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import torch
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception

from dtnode.ops import sparse
from dtnode.ops.coded import CodedDelta, CodedSlice
from dtnode.ops.quantization import dequantize, quantize, quantize_with_feedback
from dtnode.proto import averaging_pb2 as pb
from dtnode.proto import averaging_pb2_grpc as pb_grpc

from . import failpoints
from .auth import GRPC_METADATA, SwarmAuth, stream_subject
from .part_result import DriftBound, PartResult
from .plan import INT8, SPARSE, GroupPlan, chunk_spans
from .reducer import PartReduction, ReductionFailed, ReductionRegistry, maybe_thread
from .tls import TLS_NAME, TlsError, TrustStore
from .wire import (
    MAX_WEIGHT,
    WEIGHT_SLACK,
    ChunkError,
    Payload,
    RefusalReason,
    chunk_message,
    decode_chunk,
    payload_size,
)

log = logging.getLogger(__name__)


@dataclass
class PartOutcome:
    part: int
    reducer: str
    ok: bool
    included: list[str] = field(default_factory=list)
    total_weight: float = 0.0
    length: int = 0
    error: str = ""


@dataclass
class AllReduceReport:
    parts: list[PartOutcome]
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    retried: list[str] = field(default_factory=list)  # error codes of streams that broke and were sent again

    @property
    def included_peers(self) -> list[str]:
        """Peers whose contribution reached every part that succeeded."""
        ok = [set(p.included) for p in self.parts if p.ok and p.included]
        return sorted(set.intersection(*ok)) if ok else []

    @property
    def failed_parts(self) -> list[PartOutcome]:
        return [p for p in self.parts if not p.ok]

    def weight_after(self, own_weight: float) -> float:
        """The weight the averaged buffer stands for: the parts' total weights, by length.

        Parts whose reducer failed hold this member's own values and count `own_weight`.
        Moshpit hops carry this forward so token weighting survives several hops.
        """
        total = sum(p.length for p in self.parts)
        if total == 0:
            return own_weight
        return sum((p.total_weight if p.ok else own_weight) * p.length for p in self.parts) / total


RETIRING_WAIT_S = 1.0  # a stopping node waits this long for renewed channels to finish closing
RETIRING_GRACE_S = 30.0  # a channel dropped from the pool lets its open streams end within this
MAX_CHANNELS = 512  # channels pooled at once (one per peer): the least recently used goes first


class ChannelPool:
    """One long-lived gRPC channel per peer address (and, with TLS, per pinned certificate).

    A stream that broke on the transport is sent again on a channel dialled afresh (`renew`):
    sent at once on the old one it may still be given the connection that just broke (gRPC
    notices a peer's close a moment after the stream that saw it fails), and then breaks too.
    Each channel keeps its own connections, so a renewed one cannot be handed the old one's."""

    def __init__(self, max_message_bytes: int, trust: TrustStore | None = None):
        self.options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            # its own connections: gRPC's global pool would hand a renewed channel the old one's
            ("grpc.use_local_subchannel_pool", 1),
        ]
        self.trust = trust
        # by (address, pin), least recently used first; one per peer: a peer announcing another
        # address (or certificate) has its old channel closed, so nobody fills the pool
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._peer_of: dict[tuple[str, str], str] = {}
        self._retiring: set[asyncio.Task] = set()

    def _key(self, address: str, peer_id: str) -> tuple[str, str]:
        pin = ""
        if self.trust is not None:
            pin = self.trust.fingerprint_of(peer_id) or ""
            if not pin:
                raise TlsError(f"no TLS certificate known for peer {peer_id}")
        return address, pin

    def stub(self, address: str, peer_id: str) -> pb_grpc.AveragingStub:
        """A stub for `peer_id` at `address`; with TLS it trusts only that peer's certificate
        (TlsError if its record has not been read)."""
        return pb_grpc.AveragingStub(self._channel(address, peer_id))

    def _channel(self, address: str, peer_id: str) -> grpc.aio.Channel:
        key = self._key(address, peer_id)
        channel = self._channels.pop(key, None)
        if channel is None:
            for old in [k for k, p in self._peer_of.items() if p == peer_id]:
                self._retire(old, RETIRING_GRACE_S)
            while len(self._channels) >= MAX_CHANNELS:
                self._retire(next(iter(self._channels)), RETIRING_GRACE_S)
            if self.trust is None:
                channel = grpc.aio.insecure_channel(address, options=self.options)
            else:
                channel = grpc.aio.secure_channel(
                    address,
                    self.trust.channel_credentials(peer_id),
                    options=self.options + [("grpc.ssl_target_name_override", TLS_NAME)],
                )
        self._channels[key] = channel  # the most recently used last
        self._peer_of[key] = peer_id
        return channel

    def retain(self, live: set[str]) -> None:
        """Close the channels of peers no live record names (they end once their streams do)."""
        for key in [k for k, p in self._peer_of.items() if p not in live]:
            self._retire(key, RETIRING_GRACE_S)

    def _retire(self, key: tuple[str, str], grace: float) -> None:
        channel = self._channels.pop(key, None)
        self._peer_of.pop(key, None)
        if channel is not None:
            task = asyncio.ensure_future(channel.close(grace=grace))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    @property
    def size(self) -> int:
        """Channels pooled now."""
        return len(self._channels)

    async def dialable(self, address: str, peer_id: str, within: float) -> bool | None:
        """Whether this node can connect to the peer: False when the connection failed (refused,
        reset, or its TLS handshake) within `within` seconds, True once connected, None when it
        is still connecting then (a slow link proves nothing) or the peer's certificate is not
        known. The peer's pooled channel is the one dialled: a live peer is usually connected."""
        try:
            channel = self._channel(address, peer_id)
        except TlsError:
            return None
        deadline = time.monotonic() + within
        state = channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY:
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                return False
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), deadline - time.monotonic())
            except TimeoutError:
                return None
            state = channel.get_state(try_to_connect=True)
        return True

    def renew(self, address: str, peer_id: str, grace: float) -> None:
        """The next stub for this peer dials a new connection; streams still open on the old
        channel get `grace` seconds to end before it closes."""
        self._retire(self._key(address, peer_id), grace)

    async def close(self) -> None:
        channels, self._channels, self._peer_of = list(self._channels.values()), {}, {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
        if self._retiring:  # a renewed channel's streams end with the rounds; a stuck one may not delay a stop
            await asyncio.wait(self._retiring, timeout=RETIRING_WAIT_S)


@dataclass(frozen=True)
class Feedback:
    """This member's error-feedback buffer for the values it sends.

    `inject` (a hop's own Δ): what is sent is values + decay x buffer, and the buffer keeps
    what the code could not carry. Not `inject` (a later moshpit hop, whose values are a
    group's mean that already holds the buffer's mass): the buffer only collects what the
    code dropped, for the next round's Δ."""

    buffer: torch.Tensor
    inject: bool = True
    decay: float = 1.0


def _encode(
    plan: GroupPlan, values: torch.Tensor | CodedSlice, residual: torch.Tensor | None, feedback: Feedback | None
) -> Payload:
    """Encode a chunk for the plan's codec; `residual` is the chunk's slice of the feedback buffer.
    A coded Δ's chunk is its own payload: the codes it holds are what the wire carries."""
    if isinstance(values, CodedSlice):
        return values.payload()
    if plan.codec == SPARSE:
        if plan.later_sparse_hop:  # a group's mean: its largest values on their support, 8-bit
            payload = sparse.encode_mean(values, plan.block_size, plan.sender_top_k)
        elif residual is not None and feedback is not None and feedback.inject:
            return sparse.encode_with_feedback(values, residual, plan.block_size, plan.top_k, feedback.decay)
        else:
            payload = sparse.encode(values, plan.block_size, plan.top_k)
        if residual is not None and feedback is not None:  # the buffer collects what was cut
            residual.add_(values).sub_(sparse.decode(payload))
        return payload
    if plan.codec != INT8:
        return values
    if residual is not None:
        return quantize_with_feedback(values, residual, plan.block_size)
    return quantize(values, plan.block_size)


def _keep_own(
    target: torch.Tensor | CodedSlice,
    mine: torch.Tensor | CodedSlice,
    residual: torch.Tensor | None,
    before: torch.Tensor | None,
    feedback: Feedback | None,
) -> None:
    """A part whose reducer failed: this member applies its own values there exactly, with the
    feedback it would have sent (that buffer is then spent), or, at a later hop, its buffer
    goes back to what it held before this part was encoded."""
    _assign(target, mine)
    if residual is None or before is None or feedback is None:
        return
    assert isinstance(target, torch.Tensor)  # a coded Δ has no feedback on the wire
    if feedback.inject:
        target.add_(before, alpha=feedback.decay)
        residual.zero_()
    else:
        residual.copy_(before)


def _assign(target: torch.Tensor | CodedSlice, source: torch.Tensor | CodedSlice) -> None:
    """target ← source: codes into codes, fp32 into fp32 (butterfly_allreduce takes no mix)."""
    if isinstance(target, CodedSlice):
        assert isinstance(source, CodedSlice)
        target.copy_(source)
    else:
        assert isinstance(source, torch.Tensor)
        target.copy_(source)


STREAM_ATTEMPTS = 2  # a stream that broke before any result came back is sent once more
RETRIABLE = ("UNAVAILABLE", "INTERNAL")  # transport failures (gRPC core reports a refused TLS record as INTERNAL)
RETRY_TIME_LEFT = 0.3  # a stream is sent again only with this share of the timeout still left
# A reducer that has not formed our group within its registration wait says FAILED_PRECONDITION:
# it may still be reading the group's list (a DHT poll takes seconds on a loaded host) or be in
# the hop before, and then it waits for our stream until its deadline. So we ask again, paused,
# while time is left; one that formed other groups says NOT_FOUND instead (`ReductionRegistry`).
NOT_YET = "FAILED_PRECONDITION"
NOT_YET_PAUSE_S = 0.5
REDUCER_SHARE = 0.8  # a reducer stops waiting for senders here, leaving the rest to stream the result back
RESULTS_FLUSH_S = 1.0  # a reducer waits this long for its last result chunks to leave before counting them


def _code(e: BaseException | None) -> tuple[str, str]:
    """A failed stream's error code (the gRPC status, or the error's type) and detail."""
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code().name, str(e.details())
    if isinstance(e, EncodingError):
        return "ENCODING_FAILED", repr(e.__cause__)
    return type(e).__name__, str(e)


class EncodingError(RuntimeError):
    """Quantizing this member's values failed (its cause is chained): a bug, not the network."""


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


# A reducer dials the senders whose stream has not begun this long after its reduction starts,
# and again at this interval; a sender whose connection fails PROBE_FAILURES times in a row is
# gone (killed, its host down): it is dropped from the part at once, not at the deadline. The
# same cadence asks whether a group-mate formed the group at all (`absent`)
PROBE_AFTER_S = 0.5
PROBE_EVERY_S = 0.5
PROBE_FAILURES = 2


async def _safely(absent: Callable[[], Awaitable[set[str]]] | None) -> set[str]:
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


async def _unless_absent(
    work: Awaitable[PartOutcome], absent: Callable[[], Awaitable[set[str]]] | None, peer_id: str
) -> PartOutcome:
    """`work`, unless `peer_id` is found absent first (then ReducerAbsent, and `work` is cancelled)."""
    if absent is None:
        return await work
    task = asyncio.ensure_future(work)

    async def until_absent() -> None:
        await asyncio.sleep(PROBE_AFTER_S)
        while peer_id not in await _safely(absent):
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
        gone = await _safely(absent)
        for member in waiting:
            if member.peer_id in gone and member.peer_id not in reduction.progress:
                log.warning(
                    "round %s hop %s part %s: sender %s formed no group with this member; dropped from the part",
                    plan.round,
                    plan.hop,
                    reduction.part,
                    member.peer_id,
                )
                await reduction.fail(member.peer_id)
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


def _through_int8(own: torch.Tensor, block_size: int) -> torch.Tensor:
    """The reducer's own values as its senders' reach it: through the int8 code."""
    return dequantize(quantize(own, block_size))


def _sparsify_own(plan: GroupPlan, own: torch.Tensor, residual: torch.Tensor | None, feedback: Feedback | None):
    """The reducer's own values as the group sees everyone's: through the same top-k code."""
    payload = _encode(plan, own, residual, feedback)
    assert isinstance(payload, sparse.SparseBlocks)  # a sparse plan's code
    return sparse.decode(payload)


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
    absent: Callable[[], Awaitable[set[str]]] | None = None,
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
    or formed none: `peers/presence.py`): this member's reduction stops waiting for their streams,
    and its streams to their parts stop, at once rather than at the deadline.
    """
    residual = feedback.buffer if feedback is not None else None
    if values.numel() != plan.numel or out.numel() != plan.numel:
        raise ValueError("buffer size differs from the plan")
    if isinstance(values, CodedDelta) or isinstance(out, CodedDelta):
        # coded values are sent as they are and results stored as they come: the plan's int8
        # blocks must be theirs, and their feedback was taken when they were coded
        if not (isinstance(values, CodedDelta) and isinstance(out, CodedDelta)):
            raise TypeError("a coded Δ is averaged into a coded output")
        if plan.codec != INT8 or {values.block_size, out.block_size} != {plan.block_size} or feedback is not None:
            raise ValueError("a coded Δ travels in the plan's int8 blocks, with no feedback of the wire's")
    if residual is not None and residual.numel() != plan.numel:
        raise ValueError("residual size differs from the plan")
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise ValueError("weight must be finite and positive")
    if in_flight < 1:
        raise ValueError("in_flight must be >= 1")
    started = time.monotonic()
    # Reducers stop waiting for senders early enough to stream the result back in time.
    reducer_deadline = started + timeout * REDUCER_SHARE
    me = plan.index_of(own_id)
    report = AllReduceReport(parts=[])
    limit = norm_limit(plan, own_id, trim_fraction is not None)
    # members whose reducer said it formed other groups (NOT_FOUND): they send nothing to our
    # part either, so our reduction stops waiting for them at once instead of at its deadline
    # (where, holding the others' chunks, it would drop them too)
    elsewhere: set[str] = set()
    own_reduction: list[PartReduction] = []

    async def reduce_own_part() -> PartOutcome:
        offset, length = plan.parts[me]
        mine = values[offset : offset + length]
        own_residual = residual[offset : offset + length] if residual is not None else None
        own_before = own_residual.clone() if own_residual is not None and plan.codec == SPARSE else None
        if isinstance(mine, CodedSlice):  # its codes, as the group sees them
            own = await maybe_thread(mine.decoded, size=length)
        elif plan.codec == SPARSE:
            own = await maybe_thread(_sparsify_own, plan, mine, own_residual, feedback, size=length)
        elif plan.codec == INT8 and plan.sums_as_sent:  # as the group sees it
            own = await maybe_thread(_through_int8, mine, plan.block_size, size=length)
        elif own_residual is not None:  # own part is averaged exactly: spend its residual now
            own = mine + own_residual
            own_residual.zero_()
        else:
            own = mine
        kept = mine if isinstance(mine, CodedSlice) else own  # what a failed reduction leaves in place
        reduction = await maybe_thread(
            PartReduction, plan, own_id, own, weight, reducer_deadline, trim_fraction, size=length
        )
        del own  # the reduction holds its own copy: a coded Δ's decoded part goes now
        await registry.register(reduction)
        own_reduction.append(reduction)
        for member in sorted(elsewhere):
            await reduction.fail(member)
        target = out[offset : offset + length]
        result = PartResult(mine, limit, drift, offset)  # written over `target` once whole and checked
        watching = asyncio.ensure_future(drop_senders_gone(reduction, plan, channels, absent))
        try:
            for index, (off, n) in enumerate(reduction.spans):
                try:
                    payload = await reduction.wait_chunk(index)
                except ReductionFailed as e:  # logged by the reduction; its senders keep their own values too
                    if plan.codec == SPARSE:
                        _keep_own(target, mine, own_residual, own_before, feedback)
                    else:
                        _assign(target, kept)
                    return PartOutcome(me, own_id, False, [], 0.0, length, f"REDUCTION_FAILED: {e}")
                await result.add(off, n, payload)
            if result.drifted():
                _assign(target, mine)  # our senders refuse it too: nobody applies it
                return PartOutcome(me, own_id, False, [], 0.0, length, "DRIFTED: the re-synced values moved too far")
            if result.implausible():
                _assign(target, mine)  # a sender's values were far longer than ours: our senders refuse it too
                return PartOutcome(
                    me, own_id, False, [], 0.0, length, f"IMPLAUSIBLE: the mean is over {limit:g}x our norm"
                )
            await result.commit(target)
            try:  # let the last result chunks leave before counting them
                await asyncio.wait_for(reduction.streams_closed.wait(), RESULTS_FLUSH_S)
            except TimeoutError:
                pass
            report.bytes_received += reduction.bytes_received
            report.bytes_sent += reduction.bytes_sent
            return PartOutcome(me, own_id, True, reduction.included, reduction.total_weight, length)
        finally:
            watching.cancel()
            # Keep serving late result requests briefly, then forget the round.
            asyncio.get_running_loop().call_later(timeout, registry.unregister, reduction)

    async def exchange(part: int) -> PartOutcome:
        reducer = plan.members[part]
        offset, length = plan.parts[part]
        mine = values[offset : offset + length]
        mine_residual = residual[offset : offset + length] if residual is not None else None
        # encoding spends the residual: a stream sent again must start from the same one
        residual_before = mine_residual.clone() if mine_residual is not None else None
        target = out[offset : offset + length]
        received = [0]

        broke = [0]  # streams sent again after a transport failure

        def send_again(e: BaseException) -> bool:
            """The connection broke before any result came back (a reset, or bytes altered on the
            path and refused by TLS), or the reducer has not formed the group yet (NOT_YET): a
            reducer that never saw the stream would otherwise wait for it until its deadline."""
            remaining = timeout - (time.monotonic() - started)
            code = _code(e)[0]
            return (code in RETRIABLE or code == NOT_YET) and not received[0] and remaining > timeout * RETRY_TIME_LEFT

        def give_up(state: RetryCallState) -> bool:
            code = _code(state.outcome.exception() if state.outcome else None)[0]
            return code != NOT_YET and broke[0] >= STREAM_ATTEMPTS - 1

        def pause(state: RetryCallState) -> float:
            code = _code(state.outcome.exception() if state.outcome else None)[0]
            return NOT_YET_PAUSE_S if code == NOT_YET else 0.0

        def sending_again(state: RetryCallState) -> None:
            code, detail = _code(state.outcome.exception() if state.outcome else None)
            if code == NOT_YET:
                log.info(
                    "round %s hop %s: reducer %s of part %s has not formed the group yet; asking again",
                    plan.round,
                    plan.hop,
                    reducer.peer_id,
                    part,
                )
            else:
                broke[0] += 1
                channels.renew(reducer.grpc_addr, reducer.peer_id, grace=max(timeout - (time.monotonic() - started), 0))
                log.warning(
                    "round %s hop %s: stream of part %s to reducer %s broke (%s: %s); sending it again",
                    plan.round,
                    plan.hop,
                    part,
                    reducer.peer_id,
                    code,
                    detail,
                )
            report.retried.append(code)
            if mine_residual is not None and residual_before is not None:
                mine_residual.copy_(residual_before)

        async def attempt() -> PartOutcome:
            received[0] = 0
            return await stream_part(part, reducer, mine, mine_residual, target, received)

        retrying = AsyncRetrying(
            retry=retry_if_exception(send_again),
            stop=give_up,
            wait=pause,
            before_sleep=sending_again,
            reraise=True,
        )
        try:
            return await _unless_absent(retrying(attempt), absent, reducer.peer_id)
        except (TimeoutError, grpc.aio.AioRpcError, ChunkError, TlsError, EncodingError, ReducerAbsent) as e:
            code, detail = _code(e)
            if isinstance(e, EncodingError):
                log.error("round %s hop %s: encoding part %s failed", plan.round, plan.hop, part, exc_info=e.__cause__)
            if code in ("NOT_FOUND", "ReducerAbsent"):
                elsewhere.add(reducer.peer_id)
                for reduction in own_reduction:
                    await reduction.fail(reducer.peer_id)
            _keep_own(target, mine, mine_residual, residual_before, feedback)  # a failed reducer
            log.warning(
                "round %s hop %s: part %s from reducer %s failed (%s: %s); keeping own values",
                plan.round,
                plan.hop,
                part,
                reducer.peer_id,
                code,
                detail,
            )
            return PartOutcome(part, reducer.peer_id, False, [], 0.0, length, f"{code}: {detail}")

    async def stream_part(
        part: int,
        reducer,
        mine: torch.Tensor | CodedSlice,
        mine_residual: torch.Tensor | None,
        target: torch.Tensor | CodedSlice,
        received: list[int],
    ) -> PartOutcome:
        """One stream of this member's slice of `part` to its reducer, and the averaged result back."""
        length = mine.numel()
        spans = chunk_spans(plan, part)
        queue: asyncio.Queue[tuple[pb.PartChunk, int]] = asyncio.Queue(maxsize=in_flight)
        result = PartResult(mine, limit, drift, plan.parts[part][0])  # written over `target` once checked

        async def produce() -> None:
            for i, (off, n) in enumerate(spans):
                chunk_residual = mine_residual[off : off + n] if mine_residual is not None else None
                payload = await maybe_thread(_encode, plan, mine[off : off + n], chunk_residual, feedback, size=n)
                msg = chunk_message(plan, part, own_id, weight, off, payload)
                msg.last = i == len(spans) - 1
                await queue.put((msg, payload_size(payload)))

        async def requests() -> AsyncIterator[pb.PartChunk]:
            for _ in spans:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, producer}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the producer failed: end the stream now, not at the deadline
                    getter.cancel()
                    return
                msg, size = getter.result()
                if report.bytes_sent:
                    failpoints.reach("sending", plan.round)
                report.bytes_sent += size
                yield msg

        producer = asyncio.ensure_future(produce())
        try:
            remaining = timeout - (time.monotonic() - started)
            metadata = None
            if auth is not None:
                tag = auth.issue("grpc", stream_subject(plan.run_id, plan.round, plan.hop, plan.group_id, part))
                metadata = ((GRPC_METADATA, tag),)
            call = channels.stub(reducer.grpc_addr, reducer.peer_id).Reduce(
                requests(), timeout=max(remaining, 0.1), metadata=metadata
            )
            async for msg in call:
                if (
                    msg.round != plan.round
                    or msg.hop != plan.hop
                    or msg.group_id != plan.group_id
                    or msg.part != part
                    or msg.sender != reducer.peer_id
                ):
                    raise ChunkError("result chunk names another round, group, part or reducer")
                payload = decode_chunk(msg, plan, length, received[0], result=True)
                report.bytes_received += payload_size(payload)
                await result.add(received[0], msg.length, payload)
                received[0] += msg.length
                if msg.last:
                    if received[0] != length:
                        raise ChunkError(f"result ended after {received[0]} of {length} elements")
                    included = list(msg.included)
                    if own_id not in included or not set(included) <= set(plan.member_ids):
                        raise ChunkError(f"reducer's included list {included} is not valid for us")
                    if not (math.isfinite(msg.total_weight) and 0 < msg.total_weight <= MAX_WEIGHT * len(plan.members)):
                        raise ChunkError(f"reducer's total weight {msg.total_weight} is out of range")
                    expected = plan.expected_total_weight(included)
                    if expected is not None and abs(msg.total_weight - expected) > WEIGHT_SLACK * expected:
                        raise ChunkError(
                            f"reducer's total weight {msg.total_weight:g} is not its senders' {expected:g}",
                            RefusalReason.BAD_WEIGHT,
                        )
                    if result.implausible():
                        raise ChunkError(f"result norm is more than {limit:g}x our own for this part")
                    if result.drifted():
                        assert drift is not None  # only a bounded re-sync can drift
                        raise ChunkError(
                            f"the re-sync would move our values farther than this node's bound of it "
                            f"(θ_g {drift.theta:.3g}, momentum {drift.momentum:.3g})"
                        )
                    await result.commit(target)
                    return PartOutcome(part, reducer.peer_id, True, included, msg.total_weight, length)
            raise ChunkError("result stream ended without a last chunk")
        except (TimeoutError, grpc.aio.AioRpcError, ChunkError, TlsError):
            if producer.done() and not producer.cancelled() and producer.exception() is not None:
                raise EncodingError() from producer.exception()
            raise
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)

    jobs = []
    for part, (_, length) in enumerate(plan.parts):
        if length == 0:
            continue
        jobs.append(reduce_own_part() if part == me else exchange(part))
    report.parts = list(await asyncio.gather(*jobs))
    report.seconds = time.monotonic() - started
    return report
