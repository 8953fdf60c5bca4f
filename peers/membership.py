"""Swarm membership over hivemind's DHT.

Each node keeps one record under `{run_id}.peers`, subkey its peer id, refreshed by a
heartbeat and expiring `ttl` seconds after the last one: a crashed node drops out by
itself. Records read back are untrusted input and validated field by field; a malformed
record is skipped, never allowed to break the reader.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)


class JoinError(RuntimeError):
    """The DHT could not be started or the initial peers could not be reached."""


class PeerRecord(BaseModel):
    """What a node announces about itself (see ARCHITECTURE.md, membership record)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    peer_id: str = Field(max_length=128)
    grpc_addr: str = Field("", max_length=256)
    http_addr: str = Field("", max_length=256)
    state: str = Field("joining", max_length=32)
    outer_step: int = Field(0, ge=0, le=1 << 62)
    checkpoint_step: int = Field(-1, ge=-1, le=1 << 62)
    checkpoint_sha256: str = Field("", max_length=64)
    tokens_per_s: float = Field(0.0, ge=0, le=1e15)
    bandwidth_mbps: float = Field(1000.0, gt=0, le=1e9)
    device: str = Field("cpu", max_length=32)
    client_mode: bool = False
    model_hash: str = Field("", max_length=64)
    version: str = Field("", max_length=32)


def _maddr(host: str, port: int) -> str:
    proto = "ip6" if ":" in host else "ip4"
    return f"/{proto}/{host}/tcp/{port}"


async def start_dht(initial_peers: list[str], host: str, port: int, announce_host: str | None,
                    timeout: float, identity_path: str | None = None) -> hivemind.DHT:
    """Start hivemind's DHT process and reach the initial peers, or raise JoinError in bounded time."""
    for addr in initial_peers:
        if not addr.startswith("/") or "/p2p/" not in addr:
            raise JoinError(f"--peer {addr!r} is not a multiaddr like /ip4/1.2.3.4/tcp/7700/p2p/12D3Koo...")
    kwargs: dict = dict(start=True, initial_peers=initial_peers, host_maddrs=[_maddr(host, port)],
                        startup_timeout=timeout, await_ready=True)
    if identity_path:
        kwargs["identity_path"] = identity_path  # a restarted node keeps its peer id
    if announce_host and port:
        kwargs["announce_maddrs"] = [_maddr(announce_host, port)]
    try:
        return await asyncio.wait_for(asyncio.to_thread(hivemind.DHT, **kwargs), timeout + 5)
    except asyncio.TimeoutError:
        raise JoinError(f"no answer from the DHT or the initial peers within {timeout:.0f}s "
                        f"(--join-timeout); are {initial_peers} reachable?") from None
    except Exception as e:  # hivemind reports daemon failures with several exception types
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if initial_peers:
            raise JoinError(f"could not join through {', '.join(initial_peers)}: {reason}") from None
        raise JoinError(f"could not start the DHT on {host}:{port}: {reason}") from None


def public_maddrs(dht: hivemind.DHT, announce_host: str | None) -> list[str]:
    """Multiaddrs others can dial, best first: the announced host, then non-loopback, then loopback."""
    addrs = [str(a) for a in dht.get_visible_maddrs()]

    def rank(addr: str) -> int:
        parts = addr.split("/")
        host = parts[2] if len(parts) > 2 else ""
        if announce_host and host == announce_host:
            return 0
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return 3
        if ip.is_unspecified:
            return 4
        return 2 if ip.is_loopback else 1

    ranked = sorted(addrs, key=rank)
    if announce_host and (not ranked or rank(ranked[0]) != 0) and ranked:
        # Port 0 was bound before we could announce: rewrite the best address onto the announced host.
        parts = ranked[0].split("/")
        parts[1], parts[2] = ("ip6" if ":" in announce_host else "ip4"), announce_host
        ranked.insert(0, "/".join(parts))
    return ranked


class Membership:
    """This node's record in the DHT, and the swarm as the DHT shows it."""

    def __init__(self, dht: hivemind.DHT, run_id: str, ttl: float, interval: float):
        self.dht = dht
        self.key = f"{run_id}.peers"
        self.ttl = ttl
        self.interval = interval
        self.peer_id = str(dht.peer_id)
        self._last_view: dict[str, PeerRecord] = {}

    async def announce(self, record: PeerRecord) -> bool:
        return bool(await self.dht.store(self.key, subkey=self.peer_id, value=record.model_dump(),
                                         expiration_time=get_dht_time() + self.ttl, return_future=True))

    async def heartbeat(self, make_record: Callable[[], PeerRecord], stopped: asyncio.Event) -> None:
        """Re-announce until `stopped`; then let the record expire on its own."""
        while not stopped.is_set():
            try:
                await self.announce(make_record())
            except Exception as e:  # a missed beat is retried; ttl covers a couple of misses
                log.warning("heartbeat failed: %s", e)
            try:
                await asyncio.wait_for(stopped.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    async def members(self) -> dict[str, PeerRecord]:
        """Live, well-formed records by peer id (this node's own included)."""
        try:
            found = await self.dht.get(self.key, latest=True, return_future=True)
        except Exception as e:
            log.warning("membership lookup failed: %s; using the last view", e)
            return dict(self._last_view)
        view: dict[str, PeerRecord] = {}
        now = get_dht_time()
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        for subkey, item in entries.items():
            try:
                if item.expiration_time < now:
                    continue
                record = PeerRecord.model_validate(item.value)
            except (ValidationError, AttributeError, TypeError):
                log.debug("skipping malformed membership record under %r", subkey)
                continue
            if record.peer_id != subkey:
                continue  # a record must describe the peer it is filed under
            view[record.peer_id] = record
        self._last_view = view
        return view

    async def wait_for(self, count: int, timeout: float, poll: float = 0.5) -> dict[str, PeerRecord]:
        deadline = time.monotonic() + timeout
        while True:
            view = await self.members()
            if len(view) >= count or time.monotonic() >= deadline:
                return view
            await asyncio.sleep(poll)
