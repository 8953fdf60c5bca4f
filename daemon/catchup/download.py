"""Downloading one checkpoint file from the donors that serve it, in parallel ranges.

Donors that serve the same file (same step, sha256 and size: members of one group leave a
round with the same state) are used together, each fetching byte ranges of the file in
parallel, so many joiners do not all choke one donor and a donor that leaves mid-transfer
only costs its unfinished ranges. Completed ranges are remembered beside the partial file,
so an interrupted download resumes with Range requests instead of starting over. A dropped
connection is resumed from its last byte; a busy donor (503) is asked again after its
Retry-After.

Nothing a donor sends is trusted: URLs are built from the donor's announced HTTP address
and a validated integer step, never from its reply; a file larger than this model's bound
is refused before a byte is fetched; every range must come back as exactly the bytes asked
for; and the whole file must match the sha256 of the metadata.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_incrementing,
)

from dtnode.daemon.catchup.partial_download import (
    LocalDiskError,
    PartialDownload,
    TransferProgress,
    _local,
)
from dtnode.daemon.checkpoints.arrivals import Download
from dtnode.peers.auth import HTTP_HEADER, SwarmAuth
from dtnode.peers.durable import fsync_dir
from dtnode.peers.membership import PeerRecord

log = logging.getLogger(__name__)

PER_DONOR = 2  # concurrent range requests per donor
QUEUE_POLL_S = 0.02  # an idle download worker looks for ranges given back by a failed donor this often
WRITE_BATCH_BYTES = 2 << 20  # bytes received before a write (a thread hop)
MAX_BUSY_RETRIES = 20  # 503s (donor busy serving others) before a donor is given up


class DownloadError(RuntimeError):
    pass


@dataclass(frozen=True)
class Offer:
    """What one donor says it serves, and how fast it answered."""

    donor: PeerRecord
    base: str
    step: int
    sha256: str
    size: int
    latency: float
    # its step and sha256 are the ones the donor's signed record announces: only then does it
    # vote (a plain-HTTP man in the middle can swap what a donor serves, not what it signed)
    bound: bool = True
    # the network group its sidecar's address resolves to (peers/netgroups.py): whose vote it is;
    # "" when its host does not resolve (no vote)
    voter: str = ""


@dataclass(frozen=True)
class AssembledFile:
    """A checkpoint file put together from the donors' ranges, and how many donors served it."""

    path: Path
    download: Download


def auth_headers(auth: SwarmAuth | None, path: str) -> dict[str, str]:
    return {HTTP_HEADER: auth.issue("http", path)} if auth is not None else {}


RESUMES_PER_PIECE = 3  # a donor that drops a connection mid-range is asked for the rest this many times
RESUME_WAIT_S = 0.2  # before the first resume; each later one waits this much longer


async def _fetch_piece(
    session: aiohttp.ClientSession,
    offer: Offer,
    start: int,
    length: int,
    partial: PartialDownload,
    progress: TransferProgress,
    timeout: float,
    auth: SwarmAuth | None = None,
) -> None:
    """One range, written in place as it streams. A connection the donor drops (a restart of
    its keep-alive socket, a busy moment) is resumed from the byte where it stopped; a donor
    that keeps dropping it, or answers anything but the bytes asked for, has failed."""
    received = 0

    async def rest_of_range() -> None:
        nonlocal received
        try:
            received += await _fetch_range(
                session, offer, start + received, length - received, partial, progress, timeout, auth
            )
        except _Dropped as e:
            received += e.received
            raise

    def resuming(state: RetryCallState) -> None:
        cause = state.outcome.exception() if state.outcome is not None else None
        progress.resumes += 1
        log.info(
            "donor %s dropped the connection at byte %d of checkpoint %d (%s); resuming from there",
            offer.donor.peer_id[-8:],
            start + received,
            offer.step,
            getattr(cause, "cause", cause),
        )

    retrying = AsyncRetrying(
        retry=retry_if_exception_type(_Dropped),
        stop=stop_after_attempt(RESUMES_PER_PIECE + 1),
        wait=wait_incrementing(RESUME_WAIT_S, RESUME_WAIT_S),
        before_sleep=resuming,
        reraise=True,
    )
    try:
        await retrying(rest_of_range)
    except _Dropped as e:
        raise DownloadError(f"connection dropped {RESUMES_PER_PIECE + 1} times ({e.cause})") from None


async def _fetch_patiently(
    session: aiohttp.ClientSession,
    offer: Offer,
    start: int,
    length: int,
    partial: PartialDownload,
    progress: TransferProgress,
    timeout: float,
    auth: SwarmAuth | None,
) -> None:
    """`_fetch_piece`, asking again after the donor's Retry-After while it answers busy (503:
    serving others); a donor still busy after MAX_BUSY_RETRIES asks is given up (_Busy)."""
    retrying = AsyncRetrying(
        retry=retry_if_exception_type(_Busy),
        stop=stop_after_attempt(MAX_BUSY_RETRIES + 1),
        wait=_retry_after,
        reraise=True,
    )
    await retrying(_fetch_piece, session, offer, start, length, partial, progress, timeout, auth)


def _retry_after(state: RetryCallState) -> float:
    busy = state.outcome.exception() if state.outcome is not None else None
    return busy.retry_after if isinstance(busy, _Busy) else 1.0


class _Dropped(Exception):
    """The connection broke after `received` good bytes of a range."""

    def __init__(self, received: int, cause: str):
        super().__init__(cause)
        self.received = received
        self.cause = cause


async def _write_batch(partial: PartialDownload, offset: int, batch: bytearray, progress: TransferProgress) -> int:
    if not batch:
        return 0
    await asyncio.to_thread(partial.write, offset, batch)
    progress.advance(len(batch))
    return len(batch)


async def _fetch_range(
    session: aiohttp.ClientSession,
    offer: Offer,
    start: int,
    length: int,
    partial: PartialDownload,
    progress: TransferProgress,
    timeout: float,
    auth: SwarmAuth | None,
) -> int:
    headers = {"Range": f"bytes={start}-{start + length - 1}", **auth_headers(auth, f"/checkpoint/{offer.step}")}
    client_timeout = aiohttp.ClientTimeout(total=timeout, sock_read=min(timeout, 30))
    received = 0
    batch = bytearray()
    try:
        async with session.get(
            f"{offer.base}/checkpoint/{offer.step}", headers=headers, timeout=client_timeout
        ) as resp:
            if resp.status == 503:
                raise _Busy(float(resp.headers.get("Retry-After", "1") or 1))
            if resp.status != 206 and not (resp.status == 200 and start == 0 and length == offer.size):
                raise DownloadError(f"range request answered {resp.status}")
            # socket reads come in small pieces: written in batches, each a hop to a thread that
            # waits for the GIL when another thread holds it (a joiner's start-up imports do)
            async for block in resp.content.iter_any():
                if received + len(batch) + len(block) > length:
                    raise DownloadError("donor sent more bytes than the range asked for")
                batch += block
                if len(batch) >= WRITE_BATCH_BYTES:
                    received += await _write_batch(partial, start + received, batch, progress)
                    batch = bytearray()
            received += await _write_batch(partial, start + received, batch, progress)
            batch = bytearray()
    except aiohttp.ClientConnectorError:
        raise  # not a dropped transfer: the donor is not there
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as e:
        received += await _write_batch(partial, start + received, batch, progress)  # the bytes that did arrive
        raise _Dropped(received, type(e).__name__) from None
    if received != length:
        raise _Dropped(received, f"range ended after {received} of {length} bytes")
    return received


class _Busy(Exception):
    def __init__(self, retry_after: float):
        super().__init__(f"donor busy, retry after {retry_after}s")
        self.retry_after = min(max(retry_after, 0.1), 5.0)


async def download_parallel(
    session: aiohttp.ClientSession, offers: list[Offer], scratch: Path, timeout: float, auth: SwarmAuth | None = None
) -> AssembledFile:
    """Assemble one checkpoint file from ranges served by every donor in `offers` (same file)."""
    first = offers[0]
    partial = PartialDownload(scratch, first.sha256, first.size)
    resumed = sum(partial.pieces[i][1] for i in partial.finished)
    if resumed:
        log.info(
            "resuming a download of checkpoint %d: %.1f of %.1f MB already here",
            first.step,
            resumed / 1e6,
            first.size / 1e6,
        )
    progress = TransferProgress(first.size, f"checkpoint {first.step} from {len(offers)} peer(s)")
    progress.advance(resumed)
    started = time.monotonic()
    ranges = _Ranges(session, offers, partial, progress, timeout, auth)
    try:
        try:
            async with asyncio.TaskGroup() as group:
                for offer in offers:
                    for _ in range(PER_DONOR):
                        group.create_task(ranges.fetch_from(offer))
        except* LocalDiskError as errors:
            raise errors.exceptions[0] from None
        if len(partial.finished) < len(partial.pieces):
            raise DownloadError(f"every donor failed: {ranges.failures}")
        digest = await asyncio.to_thread(partial.sha256)
    finally:
        progress.close()
        partial.close()
    dest = _whole_file(partial, digest, first, scratch)
    log.info(
        "downloaded checkpoint %d from %d peer(s) of the %d that offered it: %.1f MB in %.2fs",
        first.step,
        len(ranges.served),
        len(offers),
        first.size / 1e6,
        time.monotonic() - started,
    )
    return AssembledFile(dest, Download(len(offers), len(ranges.served), first.size, resumes=progress.resumes))


class _Ranges:
    """The pieces of one download still to fetch, shared by every donor's workers: a range a
    donor fails goes back to the queue for the others, and that donor takes no more."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        offers: list[Offer],
        partial: PartialDownload,
        progress: TransferProgress,
        timeout: float,
        auth: SwarmAuth | None,
    ):
        self.session, self.offers, self.partial = session, offers, partial
        self.progress, self.timeout, self.auth = progress, timeout, auth
        self.todo: asyncio.Queue[int] = asyncio.Queue()
        for index in range(len(partial.pieces)):
            if index not in partial.finished:
                self.todo.put_nowait(index)
        self.failures: dict[str, str] = {}  # donor -> why it was given up
        self.served: dict[str, int] = {}  # donor -> bytes of this download it sent
        self.in_flight: set[int] = set()

    def _hopeless(self, offer: Offer) -> bool:
        """Nothing left for this worker: every other donor failed and no range is out or queued."""
        others_failed = all(o.donor.peer_id in self.failures for o in self.offers if o is not offer)
        return others_failed and self.todo.empty() and not self.in_flight

    async def fetch_from(self, offer: Offer) -> None:
        """One worker of `offer`'s donor: ranges from the queue until the file is whole or the
        donor fails (a LocalDiskError ends the whole download)."""
        partial = self.partial
        while offer.donor.peer_id not in self.failures and len(partial.finished) < len(partial.pieces):
            try:
                index = self.todo.get_nowait()
            except asyncio.QueueEmpty:  # ranges in flight elsewhere may still come back
                if self._hopeless(offer):
                    return
                await asyncio.sleep(QUEUE_POLL_S)
                continue
            self.in_flight.add(index)
            start, length = partial.pieces[index]
            try:
                await _fetch_patiently(
                    self.session, offer, start, length, partial, self.progress, self.timeout, self.auth
                )
                await asyncio.to_thread(partial.finish_piece, index)
                self.in_flight.discard(index)
                self.served[offer.donor.peer_id] = self.served.get(offer.donor.peer_id, 0) + length
            except LocalDiskError:
                raise  # this node's disk: ends the download (the task group stops the other workers)
            except (TimeoutError, _Busy, DownloadError, aiohttp.ClientError, OSError) as e:
                self.in_flight.discard(index)
                self.todo.put_nowait(index)  # another donor takes this range
                why = "busy" if isinstance(e, _Busy) else str(e) or type(e).__name__
                self.failures[offer.donor.peer_id] = why
                log.warning("donor %s failed (%s); its ranges go to the others", offer.donor.peer_id[-8:], why)
                return


def _whole_file(partial: PartialDownload, digest: str, offer: Offer, scratch: Path) -> Path:
    """The assembled file under its final scratch name, once its sha256 is the offer's."""
    if digest != offer.sha256:
        partial.discard()
        raise DownloadError("sha256 of the downloaded checkpoint does not match its metadata")
    dest = scratch / f".download-{offer.sha256[:16]}.safetensors"
    try:
        os.replace(partial.path, dest)  # its bytes were fsynced before they were hashed
        fsync_dir(dest.parent)
    except OSError as e:
        raise _local("rename", partial.path, e) from None
    partial.ledger.unlink(missing_ok=True)
    return dest
