"""One member's slice of a part, streamed to the part's reducer, and the checked mean back.

The slice goes out chunk by chunk, each encoded on the way (`part_codec.py`), with at most
`in_flight` encoded chunks queued ahead of the network; the mean comes back on the same
bidirectional stream while this member is still sending. A stream that broke on the transport
before any result came back is sent again once, on a channel dialled afresh; a reducer that
has not formed the group yet is asked again, paused, while time is left. The mean is written
over this member's slice only once it is whole and has passed every check (`PartResult`); a
part that fails keeps this member's own values. A reducer that dropped this member (it came
late) still streams the part's mean back, without this member's values: it is taken as it is,
the group's.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception

from dtnode.proto import averaging_pb2 as pb

from . import failpoints
from .allreduce_report import PartOutcome
from .auth import GRPC_METADATA, stream_subject
from .failure_detector import ReducerAbsent, unless_absent
from .part_codec import EncodingError, keep_own
from .part_result import PartResult
from .plan import Member, chunk_spans
from .stand_in import STAND_IN_CODES
from .tls import TlsError
from .wire import (
    FORMING_METADATA,
    LEFT_OUT_METADATA,
    MAX_WEIGHT,
    REDUCING_METADATA,
    WEIGHT_SLACK,
    ChunkError,
    RefusalReason,
    chunk_message,
    decode_chunk,
    payload_size,
)

if TYPE_CHECKING:
    from .butterfly import ButterflyAllReduce

log = logging.getLogger("dtnode.peers.butterfly")

STREAM_ATTEMPTS = 2  # a stream that broke before any result came back is sent once more
RETRIABLE = ("UNAVAILABLE", "INTERNAL")  # transport failures (gRPC core reports a refused TLS record as INTERNAL)
RETRY_TIME_LEFT = 0.3  # a stream is sent again only with this share of the timeout still left
# A reducer that has not formed our group within its registration wait says FAILED_PRECONDITION:
# it may still be reading the group's list (a DHT poll takes seconds on a loaded host) or be in
# the hop before, and then it waits for our stream until its deadline. So we ask again, paused,
# while time is left; one that formed other groups says NOT_FOUND instead (`ReductionRegistry`).
NOT_YET = "FAILED_PRECONDITION"
NOT_YET_PAUSE_S = 0.5
# how a failed part is given up: the stream's own errors, and the reducer found absent
PART_FAILURES = (TimeoutError, grpc.aio.AioRpcError, ChunkError, TlsError, EncodingError, ReducerAbsent)


def error_code(e: BaseException | None) -> tuple[str, str]:
    """A failed stream's error code (the gRPC status, or the error's type) and detail."""
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code().name, str(e.details())
    if isinstance(e, EncodingError):
        return "ENCODING_FAILED", repr(e.__cause__)
    return type(e).__name__, str(e)


def _code_of(state: RetryCallState) -> tuple[str, str]:
    return error_code(state.outcome.exception() if state.outcome else None)


class PartStream:
    """This member's side of one part another member reduces, over one all-reduce."""

    def __init__(self, run: ButterflyAllReduce, part: int, reducer: Member | None = None):
        """`reducer`: the part's stand-in, where its own reducer is not in the group (stand_in.py)."""
        self.run = run
        self.part = part
        self.reducer = reducer or run.plan.members[part]
        self.standing_in = reducer is not None
        offset, self.length = run.plan.parts[part]
        self.mine = run.values[offset : offset + self.length]
        self.residual = run.residual[offset : offset + self.length] if run.residual is not None else None
        # encoding spends the residual: a stream sent again must start from the same one
        self.residual_before = self.residual.clone() if self.residual is not None else None
        self.target = run.out[offset : offset + self.length]
        self.received = 0  # result elements back on the current attempt
        self.broke = 0  # streams sent again after a transport failure

    async def outcome(self) -> PartOutcome:
        """The part's mean written over this member's slice, or its own values kept there."""
        retrying = AsyncRetrying(
            retry=retry_if_exception(self._send_again),
            stop=self._give_up,
            wait=self._pause,
            before_sleep=self._sending_again,
            reraise=True,
        )
        try:
            return await unless_absent(retrying(self._attempt), self.run.absent, self.reducer.peer_id)
        except PART_FAILURES as e:
            return await self._failed(e)

    # ---- when to send the stream again (tenacity's hooks) ----------------------------------
    def _send_again(self, e: BaseException) -> bool:
        """The connection broke before any result came back (a reset, or bytes altered on the
        path and refused by TLS), or the reducer has not formed the group yet (NOT_YET): a
        reducer that never saw the stream would otherwise wait for it until its deadline."""
        code = error_code(e)[0]
        time_left = self.run.remaining() > self.run.timeout * RETRY_TIME_LEFT
        # a stand-in that has not taken the part after its registration wait has not found the
        # part's reducer gone (it took that reducer's mean): asking on would only cost time
        not_yet = code == NOT_YET and not self.standing_in
        return (code in RETRIABLE or not_yet) and not self.received and time_left

    def _give_up(self, state: RetryCallState) -> bool:
        return _code_of(state)[0] != NOT_YET and self.broke >= STREAM_ATTEMPTS - 1

    def _pause(self, state: RetryCallState) -> float:
        return NOT_YET_PAUSE_S if _code_of(state)[0] == NOT_YET else 0.0

    def _sending_again(self, state: RetryCallState) -> None:
        code, detail = _code_of(state)
        plan = self.run.plan
        if code == NOT_YET:
            log.info(
                "round %s hop %s: reducer %s of part %s has not formed the group yet; asking again",
                plan.round,
                plan.hop,
                self.reducer.peer_id,
                self.part,
            )
        else:
            self.broke += 1
            self.run.channels.renew(self.reducer.grpc_addr, self.reducer.peer_id, grace=max(self.run.remaining(), 0))
            log.warning(
                "round %s hop %s: stream of part %s to reducer %s broke (%s: %s); sending it again",
                plan.round,
                plan.hop,
                self.part,
                self.reducer.peer_id,
                code,
                detail,
            )
        self.run.report.retried.append(code)
        if self.residual is not None and self.residual_before is not None:
            self.residual.copy_(self.residual_before)

    async def _failed(self, e: BaseException) -> PartOutcome:
        """A failed reducer: this member keeps its own values for the part, unless the reducer is
        in no group with anyone and the part may go to its stand-in (`reducer_gone`): then the
        caller keeps them (`keep_own_values`) only if the stand-in fails too."""
        plan = self.run.plan
        code, detail = error_code(e)
        if isinstance(e, EncodingError):
            log.error("round %s hop %s: encoding part %s failed", plan.round, plan.hop, self.part, exc_info=e.__cause__)
        if code in ("NOT_FOUND", "ReducerAbsent") and not self.standing_in:
            await self.run.reducer_elsewhere(self.reducer.peer_id)
        # the reducer left the group for everyone (formed others, formed none, died), not only us out
        left_us_out = isinstance(e, grpc.aio.AioRpcError) and LEFT_OUT_METADATA in tuple(e.trailing_metadata() or ())
        gone = code in STAND_IN_CODES and not left_us_out and not self.standing_in
        if gone:
            if self.residual is not None and self.residual_before is not None:
                self.residual.copy_(self.residual_before)  # the stand-in's stream encodes from here
        else:
            self.keep_own_values()
        log.warning(
            "round %s hop %s: part %s from reducer %s failed (%s: %s); %s",
            plan.round,
            plan.hop,
            self.part,
            self.reducer.peer_id,
            code,
            detail,
            "asking its stand-in" if gone else "keeping own values",
        )
        return PartOutcome(
            self.part, self.reducer.peer_id, False, [], 0.0, self.length, f"{code}: {detail}", reducer_gone=gone
        )

    def keep_own_values(self) -> None:
        """This member's own values (and what it owed there) over its slice of the part."""
        keep_own(self.target, self.mine, self.residual, self.residual_before, self.run.feedback)

    # ---- one attempt: the stream out and the mean back -----------------------------------------
    async def _attempt(self) -> PartOutcome:
        self.received = 0
        run = self.run
        queue: asyncio.Queue[tuple[pb.PartChunk, int]] = asyncio.Queue(maxsize=run.in_flight)
        result = PartResult(self.mine, run.limit, run.drift, run.plan.parts[self.part][0])  # kept once checked
        producer = asyncio.ensure_future(self._produce(queue))
        accepted: asyncio.Future[None] | None = None
        try:
            metadata = None
            if run.auth is not None:
                plan = run.plan
                subject = stream_subject(plan.run_id, plan.round, plan.hop, plan.group_id, self.part)
                metadata = ((GRPC_METADATA, run.auth.issue("grpc", subject)),)
            call = run.channels.stub(self.reducer.grpc_addr, self.reducer.peer_id).Reduce(
                self._requests(queue, producer), timeout=max(run.remaining(), 0.1), metadata=metadata
            )
            accepted = asyncio.ensure_future(self._note_accepted(call))
            async for msg in call:
                if (done := await self._take(msg, result)) is not None:
                    return done
            raise ChunkError("result stream ended without a last chunk")
        except (TimeoutError, grpc.aio.AioRpcError, ChunkError, TlsError):
            if producer.done() and not producer.cancelled() and producer.exception() is not None:
                raise EncodingError() from producer.exception()
            raise
        finally:
            producer.cancel()
            if accepted is not None:
                accepted.cancel()
            await asyncio.gather(producer, *([accepted] if accepted is not None else []), return_exceptions=True)

    async def _note_accepted(self, call: grpc.aio.StreamStreamCall) -> None:
        """Once the reducer says it took this stream into its part, it formed this group:
        present. One that says it is still forming its groups of the hop is on its way: a
        `formed` record not read yet does not make it absent (`ButterflyAllReduce.forming`)."""
        metadata = tuple(await call.initial_metadata() or ())
        if REDUCING_METADATA in metadata:
            self.run.present.add(self.reducer.peer_id)
        if FORMING_METADATA in metadata:
            self.run.forming.add(self.reducer.peer_id)

    async def _produce(self, queue: asyncio.Queue[tuple[pb.PartChunk, int]]) -> None:
        """Encode the slice chunk by chunk, ahead of the stream by the queue's size."""
        run = self.run
        spans = chunk_spans(run.plan, self.part)
        for i, (off, n) in enumerate(spans):
            chunk_residual = self.residual[off : off + n] if self.residual is not None else None
            payload = await run.encode(self.mine[off : off + n], chunk_residual, n)
            msg = chunk_message(run.plan, self.part, run.own_id, run.weight, off, payload)
            msg.last = i == len(spans) - 1
            await queue.put((msg, payload_size(payload)))

    async def _requests(
        self, queue: asyncio.Queue[tuple[pb.PartChunk, int]], producer: asyncio.Future
    ) -> AsyncIterator[pb.PartChunk]:
        """The stream's messages as they are encoded; it ends at once if the encoding failed."""
        report = self.run.report
        for _ in chunk_spans(self.run.plan, self.part):
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, producer}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():  # the producer failed: end the stream now, not at the deadline
                getter.cancel()
                return
            msg, size = getter.result()
            if report.bytes_sent:
                failpoints.reach("sending", self.run.plan.round)
            report.bytes_sent += size
            yield msg

    async def _take(self, msg: pb.PartChunk, result: PartResult) -> PartOutcome | None:
        """One chunk of the mean, checked and added; the outcome once the last one is in."""
        plan = self.run.plan
        if (
            msg.round != plan.round
            or msg.hop != plan.hop
            or msg.group_id != plan.group_id
            or msg.part != self.part
            or msg.sender != self.reducer.peer_id
        ):
            raise ChunkError("result chunk names another round, group, part or reducer")
        payload = decode_chunk(msg, plan, self.length, self.received, result=True)
        self.run.report.bytes_received += payload_size(payload)
        await result.add(self.received, msg.length, payload)
        self.received += msg.length
        if not msg.last:
            return None
        included = self._check_last(msg, result)
        await result.commit(self.target)
        return PartOutcome(self.part, self.reducer.peer_id, True, included, msg.total_weight, self.length)

    def _check_last(self, msg: pb.PartChunk, result: PartResult) -> list[str]:
        """The whole mean's checks: its length, whom it includes, their weight, its norm and
        drift (ChunkError when one fails); the members it includes."""
        run = self.run
        if self.received != self.length:
            raise ChunkError(f"result ended after {self.received} of {self.length} elements")
        # a mean that lacks this member (the reducer dropped it: it came late) is still the
        # group's: every member takes the same bytes (`reducer.SenderLate`)
        included = list(msg.included)
        if not set(included) <= set(run.plan.member_ids) or self.reducer.peer_id not in included:
            raise ChunkError(f"reducer's included list {included} is not valid for this group")
        if not (math.isfinite(msg.total_weight) and 0 < msg.total_weight <= MAX_WEIGHT * len(run.plan.members)):
            raise ChunkError(f"reducer's total weight {msg.total_weight} is out of range")
        expected = run.plan.expected_total_weight(included)
        if expected is not None and abs(msg.total_weight - expected) > WEIGHT_SLACK * expected:
            raise ChunkError(
                f"reducer's total weight {msg.total_weight:g} is not its senders' {expected:g}",
                RefusalReason.BAD_WEIGHT,
            )
        if result.implausible():
            raise ChunkError(f"result norm is more than {run.limit:g}x our own for this part")
        if result.drifted():
            drift = run.drift
            assert drift is not None  # only a bounded re-sync can drift
            raise ChunkError(
                f"the re-sync would move our values farther than this node's bound of it "
                f"(θ_g {drift.theta:.3g}, momentum {drift.momentum:.3g})"
            )
        return included
