"""Butterfly all-reduce of one flat fp32 buffer over bidirectional gRPC streams.

The buffer is cut into parts, one per reducer (client-mode members reduce nothing). Each
member streams its slice of part j, int8-quantized chunk by chunk, to reducer j; reducer j
accumulates the weighted sum in fp32 as chunks arrive, divides by the total weight of the
senders it received in full, quantizes the mean once and streams those bytes back to every
sender. Every member, the reducer included, applies exactly those bytes, so members that
entered with identical buffers leave with identical buffers.

Failure semantics: a sender that fails mid-stream has its partial sum subtracted and is left
out of `included`; a reducer that fails leaves each sender with its own values for that part.
Nothing a peer sends is trusted: every chunk is checked against the plan before use.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import torch

from dtnode.ops.partition import plan_parts
from dtnode.ops.quantization import QuantizedBlocks, dequantize, dequantize_accumulate, num_blocks, quantize
from dtnode.proto import averaging_pb2 as pb
from dtnode.proto import averaging_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_WEIGHT = 1e12  # a weight is a token count; anything larger is a hostile or broken peer
INT8 = pb.CODEC_INT8_BLOCK
FP32 = pb.CODEC_FP32
# Tensor work on chunks smaller than this stays on the event loop: a thread hop costs more.
THREAD_THRESHOLD = 1 << 16


@dataclass(frozen=True)
class Member:
    peer_id: str
    grpc_addr: str
    client_mode: bool = False
    bandwidth: float = 1.0


@dataclass(frozen=True)
class GroupPlan:
    """What every member of a group agrees on: who is in it and who reduces which slice."""

    run_id: str
    round: int
    hop: int
    members: tuple[Member, ...]
    numel: int
    block_size: int
    chunk_elements: int
    codec: int
    parts: tuple[tuple[int, int], ...]
    group_id: bytes = field(default=b"")

    def index_of(self, peer_id: str) -> int:
        for i, m in enumerate(self.members):
            if m.peer_id == peer_id:
                return i
        raise KeyError(peer_id)

    @property
    def member_ids(self) -> list[str]:
        return [m.peer_id for m in self.members]


def make_plan(
    run_id: str,
    round: int,
    hop: int,
    members: list[Member],
    numel: int,
    block_size: int,
    chunk_elements: int,
    codec: int = INT8,
) -> GroupPlan:
    """Build the plan every member derives identically from the same member list."""
    ordered = tuple(sorted(members, key=lambda m: m.peer_id))
    if len({m.peer_id for m in ordered}) != len(ordered):
        raise ValueError("duplicate peer ids in group")
    if chunk_elements < block_size or chunk_elements % block_size:
        raise ValueError("chunk_elements must be a positive multiple of block_size")
    shares = [0.0 if m.client_mode else max(m.bandwidth, 1e-9) for m in ordered]
    parts = tuple(plan_parts(numel, shares, align=block_size))
    digest = hashlib.sha256()
    for item in (run_id, round, hop, numel, block_size, chunk_elements, codec, *[m.peer_id for m in ordered]):
        digest.update(str(item).encode() + b"\0")
    for offset, length in parts:
        digest.update(f"{offset}:{length};".encode())
    return GroupPlan(run_id, round, hop, ordered, numel, block_size, chunk_elements, codec, parts, digest.digest())


class ChunkError(ValueError):
    """A chunk that does not match the plan; its sender's contribution is discarded."""


def _frombuffer(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy read-only view of message bytes (never written to)."""
    if not data:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(data, dtype=dtype)


def decode_chunk(chunk: pb.PartChunk, plan: GroupPlan, part_length: int, expected_offset: int) -> QuantizedBlocks | torch.Tensor:
    """Validate a chunk's payload against the plan; return int8 blocks or fp32 values."""
    n = chunk.length
    if chunk.offset != expected_offset:
        raise ChunkError(f"chunk offset {chunk.offset}, expected {expected_offset}")
    if n == 0 or n > plan.chunk_elements or chunk.offset + n > part_length:
        raise ChunkError(f"chunk length {n} at offset {chunk.offset} does not fit part of {part_length}")
    if chunk.codec != plan.codec:
        raise ChunkError(f"codec {chunk.codec}, plan uses {plan.codec}")
    if plan.codec == FP32:
        if len(chunk.values) != 4 * n or chunk.scales:
            raise ChunkError("fp32 chunk has the wrong byte count")
        values = _frombuffer(chunk.values, torch.float32)
        if not bool(torch.isfinite(values).all()):
            raise ChunkError("non-finite values")
        return values
    if chunk.block_size != plan.block_size:
        raise ChunkError(f"block size {chunk.block_size}, plan uses {plan.block_size}")
    if len(chunk.values) != n or len(chunk.scales) != 4 * num_blocks(n, plan.block_size):
        raise ChunkError("int8 chunk has the wrong byte count")
    codes = _frombuffer(chunk.values, torch.int8)
    scales = _frombuffer(chunk.scales, torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ChunkError("non-finite or negative scales")
    if bool((codes == -128).any()):
        raise ChunkError("int8 code -128 is outside the symmetric range")
    return QuantizedBlocks(codes, scales, plan.block_size)


def _payload_bytes(chunk: pb.PartChunk) -> int:
    return len(chunk.values) + len(chunk.scales)


async def _maybe_thread(fn, *args, size: int):
    if size >= THREAD_THRESHOLD:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class PartReduction:
    """Reducer state for one part of one group round: the fp32 accumulator and who is in it."""

    def __init__(self, plan: GroupPlan, own_id: str, own_values: torch.Tensor, own_weight: float, deadline: float):
        self.plan = plan
        self.part = plan.index_of(own_id)
        self.offset, self.length = plan.parts[self.part]
        self.own_id = own_id
        self.deadline = deadline
        self.accumulator = own_values.to(torch.float32) * own_weight
        self.total_weight = float(own_weight)
        self.included: list[str] = [own_id]
        self.expected = {m.peer_id for m in plan.members} - {own_id}
        self.weights: dict[str, float] = {}
        self.received: dict[str, list[tuple[int, QuantizedBlocks | torch.Tensor]]] = {}
        self.finished: set[str] = set()  # committed or failed
        self.lock = asyncio.Lock()
        self.settled = asyncio.Event()
        self.result: QuantizedBlocks | torch.Tensor | None = None
        self.bytes_received = 0
        self._finalize_lock = asyncio.Lock()
        if not self.expected:
            self.settled.set()

    def begin(self, sender: str, weight: float) -> None:
        if sender not in self.expected:
            raise ChunkError(f"sender {sender} is not a member of this group")
        if sender in self.received or sender in self.finished:
            raise ChunkError(f"sender {sender} already streamed this part")
        if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
            raise ChunkError(f"weight {weight} out of range")
        if time.monotonic() > self.deadline:
            raise ChunkError("the reduction's deadline has passed")
        self.weights[sender] = weight
        self.received[sender] = []

    async def add(self, sender: str, offset: int, payload: QuantizedBlocks | torch.Tensor) -> None:
        async with self.lock:
            if sender in self.finished:
                raise ChunkError("the reduction's deadline has passed")
            # Keep a reference (not a copy) so a failure later can subtract exactly this.
            self.received[sender].append((offset, payload))
            await _maybe_thread(self._accumulate, offset, payload, self.weights[sender], 1.0, size=_numel(payload))

    def _accumulate(self, offset: int, payload, weight: float, sign: float) -> None:
        target = self.accumulator[offset : offset + _numel(payload)]
        if isinstance(payload, QuantizedBlocks):
            dequantize_accumulate(payload, target, weight * sign)
        else:
            target.add_(payload, alpha=weight * sign)

    def commit(self, sender: str) -> None:
        if sender in self.finished:
            raise ChunkError("the reduction's deadline has passed")
        self.received.pop(sender, None)  # the rollback copy is no longer needed
        self.total_weight += self.weights[sender]
        self.included.append(sender)
        self._finish(sender)

    async def fail(self, sender: str) -> None:
        """Subtract whatever the sender had added: partial contributions are discarded."""
        if sender in self.finished or sender not in self.expected:
            return
        chunks = self.received.pop(sender, [])
        async with self.lock:
            for offset, payload in chunks:
                await _maybe_thread(self._accumulate, offset, payload, self.weights[sender], -1.0, size=_numel(payload))
        self._finish(sender)

    def _finish(self, sender: str) -> None:
        self.finished.add(sender)
        if self.finished >= self.expected:
            self.settled.set()

    async def wait_result(self) -> tuple[QuantizedBlocks | torch.Tensor, list[str], float]:
        """Wait for every sender (or the deadline), then average what arrived in full, once."""
        async with self._finalize_lock:
            if self.result is None:
                remaining = self.deadline - time.monotonic()
                try:
                    await asyncio.wait_for(self.settled.wait(), max(remaining, 0))
                except asyncio.TimeoutError:
                    late = sorted(self.expected - self.finished)
                    log.warning("round %s part %s: no complete stream from %s by the deadline", self.plan.round, self.part, late)
                    for sender in late:
                        await self.fail(sender)
                self.result = await _maybe_thread(self._average, size=self.length)
        return self.result, sorted(self.included), self.total_weight

    def _average(self) -> QuantizedBlocks | torch.Tensor:
        mean = self.accumulator.div_(self.total_weight)
        if self.plan.codec == FP32:
            return mean
        return quantize(mean, self.plan.block_size)


def _numel(payload: QuantizedBlocks | torch.Tensor) -> int:
    return payload.numel if isinstance(payload, QuantizedBlocks) else payload.numel()


def chunk_spans(plan: GroupPlan, part: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of a part; shared by senders and reducers."""
    length = plan.parts[part][1]
    return [(off, min(plan.chunk_elements, length - off)) for off in range(0, length, plan.chunk_elements)]


def _chunk_message(plan: GroupPlan, part: int, sender: str, weight: float, offset: int, payload) -> pb.PartChunk:
    msg = pb.PartChunk(
        run_id=plan.run_id, round=plan.round, hop=plan.hop, group_id=plan.group_id, part=part,
        sender=sender, weight=weight, offset=offset, length=_numel(payload), codec=plan.codec,
    )
    if isinstance(payload, QuantizedBlocks):
        msg.block_size = plan.block_size
        msg.values = payload.codes.numpy().tobytes()
        msg.scales = payload.scales.numpy().tobytes()
    else:
        msg.values = payload.contiguous().numpy().tobytes()
    return msg


def _slice_payload(payload: QuantizedBlocks | torch.Tensor, offset: int, length: int, block_size: int):
    if isinstance(payload, QuantizedBlocks):
        first = offset // block_size
        return QuantizedBlocks(
            payload.codes[offset : offset + length],
            payload.scales[first : first + num_blocks(length, block_size)],
            block_size,
        )
    return payload[offset : offset + length]


def _encode(plan: GroupPlan, values: torch.Tensor) -> QuantizedBlocks | torch.Tensor:
    return quantize(values, plan.block_size) if plan.codec == INT8 else values


def _decode_into(payload: QuantizedBlocks | torch.Tensor, target: torch.Tensor) -> None:
    if isinstance(payload, QuantizedBlocks):
        dequantize(payload, out=target)
    else:
        target.copy_(payload)


class ReductionRegistry:
    """The reductions this node currently serves, keyed by what a chunk names."""

    def __init__(self) -> None:
        self._reductions: dict[tuple, PartReduction] = {}
        self._changed = asyncio.Condition()

    @staticmethod
    def key(run_id: str, round: int, hop: int, group_id: bytes, part: int) -> tuple:
        return (run_id, round, hop, bytes(group_id), part)

    async def register(self, reduction: PartReduction) -> None:
        plan = reduction.plan
        async with self._changed:
            self._reductions[self.key(plan.run_id, plan.round, plan.hop, plan.group_id, reduction.part)] = reduction
            self._changed.notify_all()

    def unregister(self, reduction: PartReduction) -> None:
        plan = reduction.plan
        self._reductions.pop(self.key(plan.run_id, plan.round, plan.hop, plan.group_id, reduction.part), None)

    async def lookup(self, key: tuple, wait: float) -> PartReduction | None:
        """A sender may reach us before we formed the same group: wait for it, boundedly."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: key in self._reductions), wait)
            except asyncio.TimeoutError:
                return None
            return self._reductions[key]


class AveragingService(pb_grpc.AveragingServicer):
    """Reducer side of the butterfly: validates and accumulates streams, returns the mean."""

    def __init__(self, registry: ReductionRegistry, run_id: str, registration_wait: float = 5.0):
        self.registry = registry
        self.run_id = run_id
        self.registration_wait = registration_wait

    async def Reduce(self, request_iterator: AsyncIterator[pb.PartChunk], context: grpc.aio.ServicerContext):
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty stream")
        if first.run_id != self.run_id:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"run {first.run_id!r} is not this node's run")
        key = ReductionRegistry.key(first.run_id, first.round, first.hop, first.group_id, first.part)
        reduction = await self.registry.lookup(key, self.registration_wait)
        if reduction is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no reduction for round {first.round} hop {first.hop} part {first.part} in this group",
            )
        sender = first.sender
        try:
            reduction.begin(sender, first.weight)
        except ChunkError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        received = 0
        try:
            chunk = first
            while True:
                if chunk.sender != sender or chunk.weight != first.weight or chunk.group_id != first.group_id \
                        or chunk.round != first.round or chunk.hop != first.hop or chunk.part != first.part \
                        or chunk.run_id != first.run_id:
                    raise ChunkError("chunk identity changed mid-stream")
                payload = decode_chunk(chunk, reduction.plan, reduction.length, received)
                reduction.bytes_received += _payload_bytes(chunk)
                await reduction.add(sender, chunk.offset, payload)
                received += chunk.length
                if chunk.last:
                    break
                chunk = await anext(aiter(request_iterator))
            if received != reduction.length:
                raise ChunkError(f"stream ended after {received} of {reduction.length} elements")
            reduction.commit(sender)
        except ChunkError as e:
            await reduction.fail(sender)
            log.warning("rejected stream from %s: %s", sender, e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except StopAsyncIteration:
            await reduction.fail(sender)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stream ended without a last chunk")
        except BaseException:
            await reduction.fail(sender)
            raise
        result, included, total_weight = await reduction.wait_result()
        plan = reduction.plan
        spans = chunk_spans(plan, reduction.part)
        for i, (offset, length) in enumerate(spans):
            msg = _chunk_message(plan, reduction.part, reduction.own_id, 0.0, offset,
                                 _slice_payload(result, offset, length, plan.block_size))
            if i == len(spans) - 1:
                msg.last = True
                msg.included.extend(included)
                msg.total_weight = total_weight
            yield msg


@dataclass
class PartOutcome:
    part: int
    reducer: str
    ok: bool
    included: list[str] = field(default_factory=list)
    error: str = ""


@dataclass
class AllReduceReport:
    parts: list[PartOutcome]
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0

    @property
    def included_peers(self) -> list[str]:
        """Peers whose contribution reached every part that succeeded."""
        ok = [set(p.included) for p in self.parts if p.ok and p.included]
        return sorted(set.intersection(*ok)) if ok else []

    @property
    def failed_parts(self) -> list[PartOutcome]:
        return [p for p in self.parts if not p.ok]


class ChannelPool:
    """One long-lived gRPC channel per peer address."""

    def __init__(self, max_message_bytes: int):
        self.options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
        ]
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> pb_grpc.AveragingStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=self.options)
            self._channels[address] = channel
        return pb_grpc.AveragingStub(channel)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)


def max_message_bytes(chunk_elements: int) -> int:
    """Largest legal message: an fp32 chunk plus its header, with headroom."""
    return 4 * chunk_elements + (1 << 16)


async def butterfly_allreduce(
    plan: GroupPlan,
    own_id: str,
    values: torch.Tensor,
    weight: float,
    out: torch.Tensor,
    registry: ReductionRegistry,
    channels: ChannelPool,
    timeout: float,
) -> AllReduceReport:
    """Average `values` (flat fp32, CPU) across the plan's members into `out`.

    Parts whose reducer fails keep this member's own values in `out`.
    """
    if values.numel() != plan.numel or out.numel() != plan.numel:
        raise ValueError("buffer size differs from the plan")
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise ValueError("weight must be finite and positive")
    started = time.monotonic()
    # Reducers stop waiting for senders early enough to stream the result back in time.
    reducer_deadline = started + timeout * 0.8
    me = plan.index_of(own_id)
    report = AllReduceReport(parts=[])
    await _maybe_thread(out.copy_, values, size=values.numel())

    async def reduce_own_part() -> PartOutcome:
        offset, length = plan.parts[me]
        reduction = await _maybe_thread(PartReduction, plan, own_id, values[offset : offset + length], weight,
                                        reducer_deadline, size=length)
        await registry.register(reduction)
        try:
            result, included, _ = await reduction.wait_result()
            await _maybe_thread(_decode_into, result, out[offset : offset + length], size=length)
            report.bytes_received += reduction.bytes_received
            return PartOutcome(me, own_id, True, included)
        finally:
            # Keep serving late result requests briefly, then forget the round.
            asyncio.get_running_loop().call_later(timeout, registry.unregister, reduction)

    async def exchange(part: int) -> PartOutcome:
        reducer = plan.members[part]
        offset, length = plan.parts[part]
        mine = values[offset : offset + length]
        spans = chunk_spans(plan, part)

        async def requests() -> AsyncIterator[pb.PartChunk]:
            for i, (off, n) in enumerate(spans):
                payload = await _maybe_thread(_encode, plan, mine[off : off + n], size=n)
                msg = _chunk_message(plan, part, own_id, weight, off, payload)
                msg.last = i == len(spans) - 1
                report.bytes_sent += _payload_bytes(msg)
                yield msg

        target = out[offset : offset + length]
        received = 0
        try:
            remaining = timeout - (time.monotonic() - started)
            call = channels.stub(reducer.grpc_addr).Reduce(requests(), timeout=max(remaining, 0.1))
            async for msg in call:
                if msg.round != plan.round or msg.group_id != plan.group_id or msg.part != part \
                        or msg.sender != reducer.peer_id:
                    raise ChunkError("result chunk names another round, group, part or reducer")
                payload = decode_chunk(msg, plan, length, received)
                report.bytes_received += _payload_bytes(msg)
                await _maybe_thread(_decode_into, payload, target[received : received + msg.length], size=msg.length)
                received += msg.length
                if msg.last:
                    if received != length:
                        raise ChunkError(f"result ended after {received} of {length} elements")
                    included = list(msg.included)
                    if own_id not in included or not set(included) <= set(plan.member_ids):
                        raise ChunkError(f"reducer's included list {included} is not valid for us")
                    return PartOutcome(part, reducer.peer_id, True, included)
            raise ChunkError("result stream ended without a last chunk")
        except (grpc.aio.AioRpcError, ChunkError, asyncio.TimeoutError) as e:
            target.copy_(mine)  # a failed reducer: keep our own values for its part
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            code = e.code().name if isinstance(e, grpc.aio.AioRpcError) else type(e).__name__
            log.warning("round %s: part %s from reducer %s failed (%s: %s); keeping own values",
                        plan.round, part, reducer.peer_id, code, detail)
            return PartOutcome(part, reducer.peer_id, False, [], f"{code}: {detail}")

    jobs = []
    for part, (_, length) in enumerate(plan.parts):
        if length == 0:
            continue
        jobs.append(reduce_own_part() if part == me else exchange(part))
    report.parts = list(await asyncio.gather(*jobs))
    report.seconds = time.monotonic() - started
    return report
