"""The averaging gRPC service: validates and folds each sender's stream into this node's
reduction of its part, while streaming the final result chunks back.

Nothing a sender says is trusted: its first chunk must name this run, carry a valid swarm
key tag (in a keyed swarm), arrive over the TLS certificate of the peer it claims to be, and
name a reduction this node serves; every chunk after it must keep that identity and pass the
wire checks (wire.py). Any violation ends the stream with a gRPC status and drops the sender
from the part; nothing it sent is kept beyond the chunks already folded in full. A member
dropped from the part only for coming late (or after an earlier stream of its failed) still
takes the part's mean back, without its values (`SenderLate`), as its group-mates do.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from dtnode.proto import averaging_pb2 as pb
from dtnode.proto import averaging_pb2_grpc as pb_grpc

from .auth import GRPC_METADATA, AuthError, SwarmAuth, stream_subject
from .netgroups import network_group
from .reducer import PartReduction, ReductionFailed, SenderAbsent, SenderLate
from .reduction_registry import ReductionRegistry
from .tls import TrustStore, client_fingerprint
from .wire import (
    FORMING_METADATA,
    LEFT_OUT_METADATA,
    REDUCING_METADATA,
    ChunkError,
    RefusalReason,
    chunk_message,
    decode_chunk,
    payload_size,
)

log = logging.getLogger(__name__)


# streams open at once on one node, from all senders together (a group of g members sends
# g - 1 per part and hop; moshpit chains and retries multiply that by a few), and from one
# network group of senders (peers/netgroups.py): slots a stream takes once its first chunk checks out
MAX_STREAMS = 128
MAX_STREAMS_PER_GROUP = 16
# streams still waiting for their first chunk, from one network group and in all: a newcomer
# past either evicts the oldest waiting one (an honest sender sends its first chunk at once; a
# slot holder that opens streams and says nothing only ever holds the newest few, briefly)
PENDING_PER_GROUP = 16
PENDING_TOTAL = 64
# a sender opens its stream with its first chunk ready (quantized while the stream starts)
FIRST_MESSAGE_TIMEOUT_S = 5.0


def stream_group(peer: str) -> str:
    """The network group of a stream's remote address ('ipv4:1.2.3.4:5678', 'ipv6:[::1]:5678')."""
    address = peer.split(":", 1)[1] if ":" in peer else peer
    host, _, port = address.rpartition(":")
    try:
        return network_group(ipaddress.ip_address(host.strip("[]").split("%", 1)[0]), int(port))
    except ValueError:
        return peer or "?"


class PendingStreams:
    """Streams that have not sent a first chunk that checks out, oldest first (see PENDING_*)."""

    def __init__(self, per_group: int = PENDING_PER_GROUP, total: int = PENDING_TOTAL):
        self.per_group, self.total = per_group, total
        self._waiting: dict[asyncio.Event, str] = {}  # each stream's eviction signal -> its group (insertion order)
        self.evicted = 0

    def admit(self, group: str) -> asyncio.Event:
        """Room for one more waiting stream of `group`; the event is set if it is evicted."""
        same = [e for e, g in self._waiting.items() if g == group]
        if len(same) >= self.per_group:
            self._evict(same[0])
        if len(self._waiting) >= self.total:
            self._evict(next(iter(self._waiting)))
        evicted = asyncio.Event()
        self._waiting[evicted] = group
        return evicted

    def _evict(self, event: asyncio.Event) -> None:
        self._waiting.pop(event, None)
        event.set()
        self.evicted += 1

    def release(self, event: asyncio.Event) -> None:
        self._waiting.pop(event, None)


def _same_stream(chunk: pb.PartChunk, first: pb.PartChunk) -> bool:
    return (chunk.sender, chunk.weight, chunk.group_id, chunk.round, chunk.hop, chunk.part, chunk.run_id) == (
        first.sender,
        first.weight,
        first.group_id,
        first.round,
        first.hop,
        first.part,
        first.run_id,
    )


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str, trailing: tuple = ()
) -> NoReturn:
    """End the stream with a status (gRPC's abort raises; this says so to the type checker)."""
    await context.abort(code, details, trailing_metadata=trailing)
    raise AssertionError("grpc's abort returned")


class AveragingService(pb_grpc.AveragingServicer):
    """Validates and folds each sender's stream while streaming final result chunks back."""

    def __init__(
        self,
        registry: ReductionRegistry,
        run_id: str,
        registration_wait: float = 5.0,
        auth: SwarmAuth | None = None,
        max_streams_per_peer: int = MAX_STREAMS_PER_GROUP,
        trust: TrustStore | None = None,
        max_streams: int = MAX_STREAMS,
        first_message_timeout: float = FIRST_MESSAGE_TIMEOUT_S,
        pending: PendingStreams | None = None,
    ):
        self.registry = registry
        self.trust = trust
        self.run_id = run_id
        self.registration_wait = registration_wait
        self.auth = auth
        self.max_streams_per_peer = max_streams_per_peer  # slots per network group of senders
        self.max_streams = max_streams
        self.first_message_timeout = first_message_timeout
        self.pending = pending or PendingStreams()
        # streams refused for what they carried, by ChunkError reason (exported as a metric)
        self.refused: collections.Counter[str] = collections.Counter()
        self._open: dict[str, int] = {}  # slots per network group: a flood from one network stays bounded
        self._open_total = 0  # ...and from all of them together: a flood from many too

    async def Reduce(self, request_iterator: AsyncIterator[pb.PartChunk], context: grpc.aio.ServicerContext):
        group = stream_group(context.peer())
        requests = aiter(request_iterator)
        first, reduction, said_forming = await self._first_checked(requests, context, group)
        if self._open.get(group, 0) >= self.max_streams_per_peer:
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many concurrent streams from this network")
        if self._open_total >= self.max_streams:
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many concurrent streams on this node")
        counted = await self._begin(first, reduction, context)
        # the sender learns at once that this member formed its group (`ButterflyAllReduce.present`),
        # unless it learnt that this member was still forming it (initial metadata goes once)
        if not said_forming:
            await context.send_initial_metadata((REDUCING_METADATA,))
        self._open[group] = self._open.get(group, 0) + 1
        self._open_total += 1
        try:
            async for msg in self._reduce(first, reduction, requests, context, counted):
                yield msg
        finally:
            self._open_total -= 1
            self._open[group] -= 1
            if not self._open[group]:
                del self._open[group]

    async def _first_checked(
        self, requests: AsyncIterator[pb.PartChunk], context: grpc.aio.ServicerContext, group: str
    ) -> tuple[pb.PartChunk, PartReduction, bool]:
        """The stream's first chunk and the reduction it names, once both check out; until then
        the stream waits in the pending pool (`PendingStreams`) and holds no slot. True: this
        node said it was still forming its groups (initial metadata, sent once)."""
        evicted = self.pending.admit(group)
        try:
            # a stream that says nothing must not hold a place until the client's own deadline
            first = await self._first_message(requests, context, evicted)
            await self._check_identity(first, context)
            reduction, said_forming = await self._reduction_for(first, context)
        finally:
            self.pending.release(evicted)
        return first, reduction, said_forming

    async def _begin(self, first: pb.PartChunk, reduction: PartReduction, context: grpc.aio.ServicerContext) -> bool:
        """The sender counts in the part from here (once it holds a slot: a stream refused for
        slots is not waited for); False for one dropped from the part, which only takes the
        mean back (`SenderLate`)."""
        try:
            reduction.begin(first.sender, first.weight)
            return True
        except SenderLate as e:
            _taking_the_mean_only(reduction, first.sender, e)
            return False
        except SenderAbsent as e:  # this member left the sender out: it stops waiting for us
            await _abort(context, grpc.StatusCode.NOT_FOUND, str(e), (LEFT_OUT_METADATA,))
        except ChunkError as e:
            if e.reason == RefusalReason.BAD_WEIGHT:  # what it carried: counted, and not waited for
                log.warning("rejected stream from %s: %s", first.sender, e)
                self.refused[e.reason] += 1
                await reduction.fail(first.sender)
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _first_message(
        self, requests: AsyncIterator[pb.PartChunk], context: grpc.aio.ServicerContext, evicted: asyncio.Event
    ) -> pb.PartChunk:
        reading = asyncio.ensure_future(anext(requests))
        # a read given up on (evicted, timed out) is cancelled, but grpc's read under it may still
        # end with an error of its own once the server stops ("Server already stopped"): taken
        # here, or asyncio logs it as a traceback at shutdown
        reading.add_done_callback(_swallow_result)
        evicting = asyncio.ensure_future(evicted.wait())
        try:
            await asyncio.wait(
                {reading, evicting}, timeout=self.first_message_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            evicting.cancel()
            if not reading.done():
                reading.cancel()
        if not reading.done() or reading.cancelled():
            if evicted.is_set():
                await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many streams waiting for a first chunk")
            await _abort(
                context, grpc.StatusCode.DEADLINE_EXCEEDED, f"no first chunk within {self.first_message_timeout:g}s"
            )
        try:
            return reading.result()
        except StopAsyncIteration:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "empty stream")

    async def _check_identity(self, first: pb.PartChunk, context: grpc.aio.ServicerContext) -> None:
        """Ends the stream with a status: a first chunk of another run, without a valid swarm key
        tag, or over a TLS certificate other than the one its claimed sender announces."""
        if first.run_id != self.run_id:
            await _abort(context, grpc.StatusCode.PERMISSION_DENIED, f"run {first.run_id!r} is not this node's run")
        if self.auth is not None:
            tag = dict(context.invocation_metadata() or ()).get(GRPC_METADATA)
            subject = stream_subject(first.run_id, first.round, first.hop, first.group_id, first.part)
            try:
                self.auth.verify("grpc", subject, tag if isinstance(tag, str) else None, peer_id=first.sender)
            except AuthError as e:
                await _abort(context, grpc.StatusCode.UNAUTHENTICATED, str(e))
        if self.trust is not None:  # the stream must come over the certificate of the peer it claims to be
            expected, presented = self.trust.fingerprint_of(first.sender), client_fingerprint(context)
            if expected is None or presented != expected:
                log.warning(
                    "refused a stream claiming peer %s over %s",
                    first.sender,
                    "the certificate of peer " + (self.trust.peer_of(presented) or "?")
                    if presented
                    else "no certificate",
                )
                await _abort(
                    context,
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"this stream's TLS certificate is not the one peer {first.sender} announces",
                )

    async def _reduction_for(
        self, first: pb.PartChunk, context: grpc.aio.ServicerContext
    ) -> tuple[PartReduction, bool]:
        key = ReductionRegistry.key(first.run_id, first.round, first.hop, first.group_id, first.part)
        # waited for (a sender may reach us before we formed the same group) only for a round this
        # node is in or about to enter, and even when this node knows it formed other groups: an
        # abort before the sender's first chunks are written reaches it as INTERNAL, not as NOT_FOUND
        wait = self.registration_wait if self.registry.may_come(first.run_id, first.round) else 0.0
        reduction = await self.registry.lookup(key, 0.0)
        said_forming = reduction is None and bool(wait) and self.registry.forming(key)
        if said_forming:
            # said at once, before the wait: the sender's group-mates may judge this node by its
            # `formed` record meanwhile, and a node still forming is on its way (`GroupPresence`)
            await context.send_initial_metadata((FORMING_METADATA,))
        if reduction is None:
            reduction = await self.registry.lookup(key, wait)
        if reduction is None and self.registry.elsewhere(key):  # the sender stops waiting for this node
            await _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"this peer is not in the group of round {first.round} hop {first.hop} the sender plans: "
                "it formed its groups of that hop with other members",
            )
        if reduction is None:
            await _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no reduction for round {first.round} hop {first.hop} part {first.part} in this group",
            )
        return reduction, said_forming

    async def _reduce(
        self,
        first: pb.PartChunk,
        reduction: PartReduction,
        requests: AsyncIterator[pb.PartChunk],
        context: grpc.aio.ServicerContext,
        counted: bool,
    ):
        """The part's mean streamed back chunk by chunk as it becomes final, while the sender's
        chunks are read and folded (`counted`; a sender dropped from the part, before its stream
        or during it, only takes the mean: `SenderLate`)."""
        sender = first.sender
        reader = asyncio.ensure_future(self._consume(reduction, sender, first, requests)) if counted else None
        reduction.open_streams += 1
        reduction.streams_closed.clear()
        try:
            for index, (offset, _) in enumerate(reduction.spans):
                waiter = asyncio.ensure_future(reduction.wait_chunk(index))
                if reader is not None and not reader.done():
                    await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                error = reader.exception() if reader is not None and reader.done() else None
                if isinstance(error, SenderLate) and reduction.failure is None:
                    _taking_the_mean_only(reduction, sender, error)
                    reader = None  # read no more of it; its mean still goes back
                elif error is not None:
                    waiter.cancel()
                    if reduction.failure is not None:  # not this sender's doing
                        await _abort(context, grpc.StatusCode.ABORTED, str(reduction.failure))
                    if isinstance(error, SenderAbsent):  # not the stream's fault: this member left it out
                        await _abort(context, grpc.StatusCode.NOT_FOUND, str(error), (LEFT_OUT_METADATA,))
                    log.warning("rejected stream from %s: %s", sender, error)
                    self.refused[getattr(error, "reason", RefusalReason.MALFORMED)] += 1
                    await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
                try:
                    payload = await waiter
                except ReductionFailed as e:
                    await _abort(context, grpc.StatusCode.ABORTED, str(e))
                msg = chunk_message(reduction.plan, reduction.part, reduction.own_id, 0.0, offset, payload, result=True)
                if index == len(reduction.spans) - 1:
                    msg.last = True
                    msg.included.extend(reduction.included)
                    msg.total_weight = reduction.total_weight
                yield msg
                reduction.bytes_sent += payload_size(payload)
        finally:
            reduction.open_streams -= 1
            if not reduction.open_streams:
                reduction.streams_closed.set()
            if reader is None:
                pass  # never read, or its error (SenderLate) already taken
            elif not reader.done():
                reader.cancel()
                await reduction.fail(sender)
            elif not reader.cancelled():
                # the stream ended on the reduction's failure or this sender's chunk that came
                # after the deadline, while the reader failed too: both already said so (the
                # reducer's log, the abort), and unretrieved the reader's error became an
                # "exception was never retrieved" traceback in the log
                reader.exception()

    async def _consume(
        self, reduction: PartReduction, sender: str, first: pb.PartChunk, requests: AsyncIterator[pb.PartChunk]
    ) -> None:
        """Read, validate and fold the sender's chunks; any violation drops the sender."""
        received = 0
        try:
            chunk = first
            for index, (offset, _) in enumerate(reduction.spans):
                if not _same_stream(chunk, first):
                    raise ChunkError("chunk identity changed mid-stream")
                payload = decode_chunk(chunk, reduction.plan, reduction.length, offset)
                if chunk.length != reduction.spans[index][1]:
                    raise ChunkError(f"chunk {index} has {chunk.length} values, expected {reduction.spans[index][1]}")
                reduction.bytes_received += payload_size(payload)
                await reduction.add(sender, index, payload)
                received += chunk.length
                if index == len(reduction.spans) - 1:
                    if not chunk.last:
                        raise ChunkError("the part's last chunk is not marked last")
                    return
                if chunk.last:
                    raise ChunkError(f"stream ended after {received} of {reduction.length} elements")
                chunk = await anext(requests)
        except StopAsyncIteration:
            await reduction.fail(sender)
            raise ChunkError("stream ended without a last chunk") from None
        except BaseException:
            await reduction.fail(sender)
            raise


def _taking_the_mean_only(reduction: PartReduction, sender: str, why: SenderLate) -> None:
    log.info(
        "round %s hop %s part %s: %s",
        reduction.plan.round,
        reduction.plan.hop,
        reduction.part,
        why,
    )


def _swallow_result(task: asyncio.Future) -> None:
    """Marks a read's error as retrieved: whoever still waited for it read it first."""
    if not task.cancelled():
        task.exception()
