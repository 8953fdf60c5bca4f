"""Catching up with the swarm: download the newest checkpoint from a peer's sidecar.

The donor is whichever live member announces the highest checkpoint step for our model.
The URL is built from the donor's announced HTTP address and a step number, never taken
from the donor's reply; the file is streamed to disk with a size cap, its sha256 checked
against both the donor's metadata and its DHT record, and then validated like any
checkpoint. Any failure moves on to the next donor.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from pathlib import Path

import aiohttp

from dtnode.peers.membership import PeerRecord

from .checkpoint import CheckpointError, Layout, LoadedCheckpoint, read_checkpoint

log = logging.getLogger(__name__)


class DownloadError(RuntimeError):
    pass


async def download_checkpoint(session: aiohttp.ClientSession, donor: PeerRecord, dest: Path, layout: Layout,
                              timeout: float) -> Path:
    base = donor.http_addr.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise DownloadError(f"peer {donor.peer_id} announces no usable HTTP address")
    client_timeout = aiohttp.ClientTimeout(total=timeout, sock_read=min(timeout, 30))
    async with session.get(f"{base}/checkpoint", timeout=client_timeout) as resp:
        if resp.status != 200:
            raise DownloadError(f"{base}/checkpoint answered {resp.status}")
        meta = await resp.json(content_type=None)
    step, sha256 = meta.get("outer_step"), meta.get("sha256")
    if not isinstance(step, int) or step < 0 or not isinstance(sha256, str) or len(sha256) != 64:
        raise DownloadError(f"{base}/checkpoint returned malformed metadata")
    if step == donor.checkpoint_step and sha256 != donor.checkpoint_sha256:
        raise DownloadError("checkpoint hash differs from the donor's DHT record")
    limit = layout.file_size_bound()
    digest = hashlib.sha256()
    size = 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    async with session.get(f"{base}/checkpoint/{step}", timeout=client_timeout) as resp:
        if resp.status != 200:
            raise DownloadError(f"checkpoint download answered {resp.status}")
        if resp.content_length is not None and resp.content_length > limit:
            raise DownloadError(f"checkpoint of {resp.content_length} bytes exceeds this model's bound {limit}")
        with open(dest, "wb") as f:
            async for block in resp.content.iter_chunked(1 << 20):
                size += len(block)
                if size > limit:
                    raise DownloadError(f"checkpoint exceeds this model's bound of {limit} bytes")
                digest.update(block)
                await asyncio.to_thread(f.write, block)
    if digest.hexdigest() != sha256:
        raise DownloadError("sha256 of the downloaded checkpoint does not match its metadata")
    log.info("downloaded checkpoint %s from %s: %.1f MB in %.2fs", step, donor.peer_id[-8:], size / 1e6,
             time.monotonic() - started)
    return dest


async def fetch_from_swarm(members: dict[str, PeerRecord], own_id: str, own_step: int, model_hash: str, run_id: str,
                           layout: Layout, scratch: Path, timeout: float) -> LoadedCheckpoint | None:
    """The newest checkpoint ahead of `own_step` that any member serves, or None."""
    donors = sorted(
        (m for m in members.values()
         if m.peer_id != own_id and m.model_hash == model_hash and m.checkpoint_step > own_step and m.http_addr),
        key=lambda m: -m.checkpoint_step,
    )
    async with aiohttp.ClientSession() as session:
        for donor in donors:
            dest = scratch / f".download-{donor.peer_id[-12:]}.safetensors"
            try:
                path = await download_checkpoint(session, donor, dest, layout, timeout)
                return await asyncio.to_thread(read_checkpoint, path, layout, run_id, model_hash)
            except (DownloadError, CheckpointError, aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                log.warning("could not sync from %s (%s): %s; trying the next peer", donor.peer_id[-8:],
                            donor.http_addr, e)
            finally:
                dest.unlink(missing_ok=True)
    return None
