"""Can the swarm reach this node? The announced address, and a dial-back by a live peer.

A node behind NAT, a cloud VM that announces its private address, a firewall that drops the
gRPC port: each looks healthy from inside (the node trains, its own peers answer it) while
every group that picks it waits out a timeout. So the node checks from outside:

- at start, an announced address that is private, loopback or link-local is warned about,
  with the flag that fixes it (only when the address was not given with --announce-host);
- once a live peer is known, the node asks that peer's sidecar to dial its announced gRPC
  and HTTP addresses back (`GET /dialback?peer=<id>`), and reports the answer in its log,
  `/status` and the dashboard.

The peer dials only the addresses in the asker's signed membership record, never an address
named in the request. Records are the asker's to write, so a dial-back is bounded like any
other service to strangers: each peer id is answered once per DIAL_BACK_REUSE_S, asks for one
id while its dial runs share that dial, all ids together get DIALS_PER_MINUTE (ids are free),
the HTTP dial follows no redirect, and the answer says reachable or not, never why (an error
text told a port scanner what it found).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.stopping import pause
from dtnode.peers.auth import HTTP_HEADER, SwarmAuth
from dtnode.peers.membership import PeerRecord

log = logging.getLogger("dtnode")

DIAL_TIMEOUT_S = 5.0  # one connection attempt of a dial-back
DIAL_BACK_REUSE_S = 60.0  # a peer's answer to the same asker is reused this long
DIALS_PER_MINUTE = 12  # new dial-backs this node makes, for all askers together
ASK_EVERY_S = 5.0  # how often a node with no live peer yet looks for one to ask
MAX_ERROR_CHARS = 200
UNREACHABLE = "unreachable"  # all a dial-back says of a failed dial


def announce_warning(settings: NodeSettings, host: str) -> str | None:
    """The warning for an announced address other hosts cannot dial, unless it was chosen."""
    if settings.network.announce_host:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None  # a name: resolved by the peers
    kind = "loopback" if ip.is_loopback else "link-local" if ip.is_link_local else "private" if ip.is_private else None
    if kind is None:
        return None
    return (
        f"this node announces {host}, a {kind} address: peers on other hosts or networks cannot dial it; "
        f"give --announce-host with this host's public address or DNS name (and open the DHT, gRPC and HTTP "
        f"ports), or --client-mode behind NAT"
    )


class Reachability(BaseModel):
    """A peer's dial-back of this node's announced endpoints (`/status`'s `reachability`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    checked_by: str = Field(max_length=128)
    grpc_addr: str = Field(max_length=256)
    grpc_error: str | None = Field(None, max_length=MAX_ERROR_CHARS)  # None: reachable (or client mode)
    http_addr: str = Field(max_length=256)
    http_error: str | None = Field(None, max_length=MAX_ERROR_CHARS)
    checked_at: float = 0.0  # unix time

    @property
    def ok(self) -> bool:
        return self.grpc_error is None and self.http_error is None

    def describe(self) -> str:
        parts = []
        for name, addr, error in (("gRPC", self.grpc_addr, self.grpc_error), ("HTTP", self.http_addr, self.http_error)):
            if addr:
                parts.append(f"{name} {addr} {'reachable' if error is None else f'unreachable ({error})'}")
        return f"peer {self.checked_by} dialled this node back: " + ", ".join(parts)


async def _dial_tcp(addr: str) -> str | None:
    host, _, port = addr.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), DIAL_TIMEOUT_S)
    except (OSError, TimeoutError, ValueError) as e:
        log.debug("dial-back of %s failed: %s", addr, e)
        return UNREACHABLE
    writer.close()
    return None


async def _dial_http(url: str) -> str | None:
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=DIAL_TIMEOUT_S), allow_redirects=False),
        ):
            return None  # any answer: the port is open to this peer (503 is a health matter)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
        log.debug("dial-back of %s failed: %s", url, e)
        return UNREACHABLE


class DialBusy(RuntimeError):
    """This node made its DIALS_PER_MINUTE dial-backs this minute: ask again later."""


class DialBack:
    """The serving side: dials a member's recorded endpoints (see the module for the limits)."""

    def __init__(self, own_id: str, members: Callable[[], Awaitable[dict[str, PeerRecord]]]):
        self.own_id = own_id
        self.members = members
        self.answers: dict[str, tuple[float, Reachability]] = {}
        self.dialling = asyncio.Semaphore(2)
        self._running: dict[str, asyncio.Future[Reachability]] = {}  # one dial per peer id at a time
        self._dialled_at: list[float] = []  # when the dials of the last minute began

    async def dial(self, peer_id: str) -> Reachability | None:
        """None when `peer_id` has no live record (nothing to dial); DialBusy past the rate."""
        now = time.monotonic()
        self.answers = {p: a for p, a in self.answers.items() if now - a[0] < DIAL_BACK_REUSE_S}
        if peer_id in self.answers:
            return self.answers[peer_id][1]
        if peer_id in self._running:
            return await asyncio.shield(self._running[peer_id])
        record = (await self.members()).get(peer_id)
        if record is None:
            return None
        if peer_id in self._running:  # began while the records were read
            return await asyncio.shield(self._running[peer_id])
        self._dialled_at = [at for at in self._dialled_at if now - at < 60.0]
        if len(self._dialled_at) >= DIALS_PER_MINUTE:
            raise DialBusy(f"{DIALS_PER_MINUTE} dial-backs this minute already")
        self._dialled_at.append(now)
        running = asyncio.ensure_future(self._dial(record))
        self._running[peer_id] = running
        try:
            return await asyncio.shield(running)
        finally:
            if running.done():
                self._running.pop(peer_id, None)
            else:
                running.add_done_callback(lambda _: self._running.pop(peer_id, None))

    async def _dial(self, record: PeerRecord) -> Reachability:
        peer_id = record.peer_id
        async with self.dialling:
            grpc_error = None if record.client_mode or not record.grpc_addr else await _dial_tcp(record.grpc_addr)
            http_ok = bool(record.http_addr) and urlsplit(record.http_addr).scheme in ("http", "https")
            http_error = await _dial_http(record.http_addr) if http_ok else "no HTTP address in its record"
        answer = Reachability(
            checked_by=self.own_id,
            grpc_addr="" if record.client_mode else record.grpc_addr,
            grpc_error=grpc_error,
            http_addr=record.http_addr,
            http_error=http_error,
            checked_at=time.time(),
        )
        self.answers[peer_id] = (time.monotonic(), answer)
        return answer


def _candidates(view: dict[str, PeerRecord], own_id: str) -> list[PeerRecord]:
    return [
        r
        for p, r in view.items()
        if p != own_id and r.http_addr and not r.client_mode and r.state in ("training", "averaging")
    ]


async def ask_dial_back(
    own_id: str,
    members: Callable[[], Awaitable[dict[str, PeerRecord]]],
    auth: SwarmAuth | None,
    stopping: asyncio.Event,
) -> Reachability | None:
    """Wait for a live peer, ask it to dial this node back, and log what it found. None when the
    node stops first or no peer could answer."""
    while not stopping.is_set():
        for peer in _candidates(await members(), own_id):
            url = f"{peer.http_addr}/dialback"
            headers = {HTTP_HEADER: auth.issue("http", "/dialback")} if auth is not None else {}
            try:
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(
                        url,
                        params={"peer": own_id},
                        headers=headers,
                        timeout=aiohttp.ClientTimeout(total=3 * DIAL_TIMEOUT_S),
                    ) as resp,
                ):
                    if resp.status != 200:
                        continue  # it does not know this node's record yet, or is an older version
                    answer = Reachability.model_validate_json(await resp.content.read(1 << 16))
            except (aiohttp.ClientError, OSError, TimeoutError, ValidationError) as e:
                log.debug("dial-back by %s failed: %s", peer.peer_id, e)
                continue
            if answer.ok:
                log.info("%s", answer.describe())
            else:
                log.warning(
                    "%s: peers cannot reach this node; open those ports to the swarm, give --announce-host with "
                    "an address they can dial, or run with --client-mode behind NAT",
                    answer.describe(),
                )
            return answer
        await pause(stopping, ASK_EVERY_S)
    return None
