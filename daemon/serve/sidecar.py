"""The HTTP sidecar: health, status, history, peers, metrics, checkpoints and the dashboard
on one aiohttp server, or (--status-port) what operators read on a second one, apart from
what peers need (checkpoints, /healthz, /dialback), so the public port shows no state.

It runs on the node's event loop but never waits on training or averaging: every handler
reads state the node has already published, and checkpoint files stream from disk, so a
node in the middle of an all-reduce still answers at once.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import ipaddress
import json
import logging
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from rich.filesize import decimal

from dtnode.daemon.checkpoints.file_format import MAX_STEP, CheckpointInfo
from dtnode.daemon.checkpoints.in_memory import MemoryCheckpoint
from dtnode.daemon.records.history import RoundHistory
from dtnode.daemon.records.status import Health, NodeStatus
from dtnode.daemon.swarm.reachability import DialBusy, Reachability
from dtnode.daemon.telemetry.metrics import NodeMetrics
from dtnode.daemon.workload.recipe import RECIPE_PATH
from dtnode.peers.auth import HTTP_HEADER, AuthError, SwarmAuth
from dtnode.peers.netgroups import network_group

log = logging.getLogger(__name__)

MEMORY_CHUNK = 1 << 20  # bytes of a checkpoint served from memory per write
# A download slot is held at most DOWNLOAD_GRACE_S plus the size at MIN_DOWNLOAD_RATE: a reader
# slower than that (4 Mbit/s), or one that stopped reading, is cut and its slot freed
MIN_DOWNLOAD_RATE = 512 * 1024  # bytes per second
DOWNLOAD_GRACE_S = 30.0
SERVED_RECENTLY_S = 120.0  # a checkpoint asked for within this long is not pruned
MAX_PINNED = 2  # steps pinned at once (each a copy of θ_g and the momentum in memory, or a file kept)
PINS_PER_GROUP = 1  # steps one network group of askers may hold pinned
PROTECTED = ("/checkpoint", "/peers", "/dialback", RECIPE_PATH)
HISTORY_PAGE = 200  # rounds per /history answer at most: a page is serialized off the event loop


class NodeView(Protocol):
    """What the sidecar needs from the node."""

    @property
    def metrics_registry(self) -> CollectorRegistry: ...
    @property
    def metrics(self) -> NodeMetrics: ...
    @property
    def history(self) -> RoundHistory: ...
    @property
    def export_format(self) -> str: ...

    def status(self) -> NodeStatus: ...

    @property
    def recipe_json(self) -> str: ...

    def health(self) -> Health: ...

    def readiness(self) -> Health: ...

    async def peer_records(self) -> list[dict[str, Any]]: ...

    def checkpoint(self, step: int | None = None) -> CheckpointInfo | None: ...

    def memory_checkpoint(self, step: int) -> MemoryCheckpoint | None: ...

    async def current_checkpoint(self) -> CheckpointInfo | None: ...

    async def dial_back(self, peer_id: str) -> Reachability | None: ...


class ServedSteps:
    """Steps a joiner asked for or fetched ranges of lately (pinned): pruning keeps their files,
    and an outer step keeps serving them from copies (a model's θ_g and momentum each, on a CPU
    node), so a download that spans this node's round boundary still finds its bytes. (Read from
    the training thread too: no writes there.)

    Pins cost memory and disk, so they hold a budget: a pin comes only with an answer served
    (not a 404 or a 503), each network group of askers (peers/netgroups.py) holds PINS_PER_GROUP
    steps at most (its newest), and MAX_PINNED steps are held in all (the newest asked for). A
    reader asking for every step several times a second pins one; it used to pin them all."""

    def __init__(self, within: float = SERVED_RECENTLY_S, max_steps: int = MAX_PINNED, per_group: int = PINS_PER_GROUP):
        self.within = within
        self.max_steps, self.per_group = max_steps, per_group
        self._pins: dict[tuple[str, int], float] = {}  # (asker's network group, step) -> when it last asked

    def mark(self, step: int, asker: str = "") -> None:
        now = time.monotonic()
        pins = {key: at for key, at in self._pins.items() if at > now - self.within}
        pins[(asker, step)] = now
        own = sorted((at, s) for (group, s), at in pins.items() if group == asker)
        for _, old in own[: -self.per_group]:
            del pins[(asker, old)]
        latest: dict[int, float] = {}
        for (_, s), at in pins.items():
            latest[s] = max(latest.get(s, 0.0), at)
        kept = set(sorted(latest, key=lambda s: latest[s])[-self.max_steps :])
        self._pins = {key: at for key, at in pins.items() if key[1] in kept}

    def in_use(self) -> set[int]:
        cutoff = time.monotonic() - self.within
        return {step for (_, step), at in list(self._pins.items()) if at > cutoff}


# The sidecar's parsers of what a request names (untrusted): each answers a value or raises
# HTTPBadRequest, whatever it is given (tests/test_untrusted_input.py feeds them thousands).


def path_step(raw: str) -> int:
    """`/checkpoint/{step}`: only a plain decimal integer ever reaches a file name."""
    if not raw.isascii() or not raw.isdigit() or len(raw) > 19 or int(raw) > MAX_STEP:
        raise web.HTTPBadRequest(text="step must be a non-negative integer")
    return int(raw)


def history_query(query: Mapping[str, str]) -> tuple[int, int]:
    """`/history?since=&limit=`: (since, limit)."""
    since_text, limit_text = query.get("since", "-1"), query.get("limit", str(HISTORY_PAGE))
    if not all(t.isascii() and len(t) <= 20 for t in (since_text, limit_text)):
        raise web.HTTPBadRequest(text="since and limit must be integers")
    try:
        since, limit = int(since_text), int(limit_text)
    except ValueError:
        raise web.HTTPBadRequest(text="since and limit must be integers") from None
    if not -1 <= since <= MAX_STEP or not 1 <= limit <= HISTORY_PAGE:
        raise web.HTTPBadRequest(text=f"since must be -1..{MAX_STEP} and limit 1..{HISTORY_PAGE}")
    return since, limit


def dialback_peer(query: Mapping[str, str]) -> str:
    """`/dialback?peer=`: the asking node's peer id."""
    peer = query.get("peer", "")
    if not 0 < len(peer) <= 128 or not peer.isascii() or not peer.isalnum():
        raise web.HTTPBadRequest(text="give ?peer=<the asking node's peer id>")
    return peer


def asker_group(request: web.Request) -> str:
    """The network group of the address a request came from (a pin's owner): on loopback, where
    only this machine's processes connect (several nodes of one host), each connection its own."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    port = peer[1] if isinstance(peer, tuple) and len(peer) >= 2 else None
    try:
        return network_group(ipaddress.ip_address(request.remote or ""), port)
    except ValueError:
        return request.remote or "?"


class _HeldFileResponse(web.FileResponse):
    """A file response the handler sends itself (to hold a download slot while it streams):
    aiohttp prepares a returned response once more, which must then do nothing."""

    async def prepare(self, request: web.BaseRequest):
        if self.prepared:
            return self._payload_writer
        return await super().prepare(request)


class Sidecar:
    def __init__(
        self,
        node: NodeView,
        max_downloads: int = 4,
        auth: SwarmAuth | None = None,
        served: ServedSteps | None = None,
        min_download_rate: float = MIN_DOWNLOAD_RATE,
        download_grace: float = DOWNLOAD_GRACE_S,
        separate_status: bool = False,
    ):
        self.node = node
        self.served = served or ServedSteps()
        self.auth = auth
        self.downloads = asyncio.Semaphore(max_downloads)
        self.min_download_rate, self.download_grace = min_download_rate, download_grace
        self.app = web.Application(middlewares=[self._require_key])
        self.app.add_routes(self._public_routes())
        # --status-port: the operator's routes on a listener of their own (`start_status`)
        self.status_app = web.Application(middlewares=[self._require_key]) if separate_status else self.app
        if separate_status:
            self.status_app.add_routes([web.get("/healthz", self.healthz), web.get("/readyz", self.readyz)])
        self.status_app.add_routes(self._status_routes())
        self.runner: web.AppRunner | None = None
        self.status_runner: web.AppRunner | None = None
        self._dashboard = importlib.resources.files(__package__).joinpath("dashboard.html").read_text("utf-8")
        self.port = 0
        self._from_memory: set[int] = set()  # steps already logged as served from memory

    def _public_routes(self) -> list[web.RouteDef]:
        """What other peers ask of this node."""
        return [
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/checkpoint", self.checkpoint_meta),
            web.get("/checkpoint/{step}", self.checkpoint_file),
            web.get("/dialback", self.dialback),
            web.get(RECIPE_PATH, self.recipe),
        ]

    def _status_routes(self) -> list[web.RouteDef]:
        """What an operator reads (and `join --peer http://` reads: /status)."""
        return [
            web.get("/status", self.status),
            web.get("/peers", self.peers),
            web.get("/metrics", self.metrics),
            web.get("/history", self.history),
            web.get("/", self.dashboard),
        ]

    def steps_in_use(self) -> set[int]:
        return self.served.in_use()

    @web.middleware
    async def _require_key(self, request: web.Request, handler):
        """With a swarm key, state and membership are for key holders; health and metrics stay open."""
        if self.auth is not None and request.path.startswith(PROTECTED):
            try:
                self.auth.verify("http", request.path, request.headers.get(HTTP_HEADER))
            except AuthError as e:
                raise web.HTTPUnauthorized(text=f"swarm key required: {e}") from None
        return await handler(request)

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port); returns the bound port."""
        self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port, reuse_address=True).start()
        self.port = self.runner.addresses[0][1]  # the bound port when port was 0
        return self.port

    async def start_status(self, host: str, port: int) -> int:
        """With `separate_status`: the operator's listener; returns its bound port."""
        if self.status_app is self.app:
            raise RuntimeError("this sidecar serves its status on its one port")
        self.status_runner = web.AppRunner(self.status_app, access_log=None, handle_signals=False)
        await self.status_runner.setup()
        await web.TCPSite(self.status_runner, host, port, reuse_address=True).start()
        return self.status_runner.addresses[0][1]

    async def stop(self) -> None:
        for runner in (self.status_runner, self.runner):
            if runner is not None:
                await runner.cleanup()

    async def healthz(self, request: web.Request) -> web.Response:
        health = self.node.health()
        return web.json_response(health.model_dump(mode="json"), status=200 if health.ok else 503)

    async def readyz(self, request: web.Request) -> web.Response:
        readiness = self.node.readiness()
        return web.json_response(readiness.model_dump(mode="json"), status=200 if readiness.ok else 503)

    async def recipe(self, request: web.Request) -> web.Response:
        """The recipe's JSON, byte for byte what the record's sha256 is of (a joiner whose
        recipe differs reads it to name the fields: daemon/catchup/admission.py)."""
        return web.Response(text=self.node.recipe_json, content_type="application/json")

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.node.status().model_dump(mode="json"))

    async def peers(self, request: web.Request) -> web.Response:
        return web.json_response(await self.node.peer_records())

    async def dialback(self, request: web.Request) -> web.Response:
        """Dial the asking member's recorded gRPC and HTTP addresses (swarm/reachability.py)."""
        peer = dialback_peer(request.query)
        try:
            answer = await self.node.dial_back(peer)
        except DialBusy:
            raise web.HTTPTooManyRequests(text="too many dial-backs lately", headers={"Retry-After": "10"}) from None
        if answer is None:
            raise web.HTTPNotFound(text=f"no live membership record of {peer}")
        return web.json_response(answer.model_dump(mode="json"))

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.node.metrics_registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def checkpoint_meta(self, request: web.Request) -> web.Response:
        try:
            info = await self.node.current_checkpoint()
        except TimeoutError:
            raise web.HTTPServiceUnavailable(text="writing the current checkpoint", headers={"Retry-After": "2"})
        if info is None:
            raise web.HTTPNotFound(text="no checkpoint yet")
        self.served.mark(
            info.step, asker_group(request)
        )  # a joiner's ranges follow: the step must outlive the next outer step
        return web.json_response(
            {
                "outer_step": info.step,
                "sha256": info.sha256,
                "size_bytes": info.size_bytes,
                "url": str(request.url.with_path(f"/checkpoint/{info.step}").with_query(None)),
                "export_format": self.node.export_format,  # what `dtnode export` makes of it
            }
        )

    async def checkpoint_file(self, request: web.Request) -> web.StreamResponse:
        step = path_step(request.match_info["step"])
        info = self.node.checkpoint(step)
        on_disk = info if info is not None and Path(info.path).is_file() else None
        memory = self.node.memory_checkpoint(step) if on_disk is None else None
        if on_disk is None and memory is None:
            raise web.HTTPNotFound(text=f"no checkpoint for step {step}")
        if self.downloads.locked():
            raise web.HTTPServiceUnavailable(text="too many downloads in progress", headers={"Retry-After": "2"})
        self.served.mark(step, asker_group(request))  # served: its bytes must outlive the next outer step
        if memory is not None:
            async with self.downloads:
                return await self._in_time(request, memory.size, self._serve_from_memory(request, memory))
        assert on_disk is not None
        async with self.downloads:
            response = _HeldFileResponse(
                on_disk.path,
                chunk_size=1 << 20,
                headers={
                    "X-Checkpoint-Sha256": on_disk.sha256,
                    "X-Checkpoint-Step": str(on_disk.step),
                    "Content-Type": "application/octet-stream",
                },
            )

            async def send() -> web.StreamResponse:
                await response.prepare(request)  # sends the whole file while we hold the slot
                self.node.metrics.checkpoint_served.inc(response.content_length or 0)
                return response

            return await self._in_time(request, on_disk.size_bytes, send())

    async def _in_time(
        self, request: web.Request, size: int, sending: Coroutine[Any, Any, web.StreamResponse]
    ) -> web.StreamResponse:
        """Send within the slot's time (the grace plus `size` at the minimum rate), or cut the
        connection: a reader that is too slow, or stopped reading, must not keep a slot."""
        allowed = self.download_grace + size / self.min_download_rate
        try:
            return await asyncio.wait_for(sending, allowed)
        except ConnectionError:  # reset, broken pipe, or aiohttp's "Connection lost"
            # the reader went away mid-file (a joiner that stopped, a reader that asks and leaves):
            # nothing is left to answer, and nothing went wrong here (aiohttp logged it as an error
            # with a traceback when it reached the server's own handling)
            log.info("a checkpoint download to %s ended early: the reader closed the connection", request.remote)
            if request.transport is not None:
                request.transport.abort()
            raise web.HTTPBadRequest(text="the reader closed the connection") from None
        except TimeoutError:
            log.warning(
                "cut a checkpoint download to %s after %.0fs: slower than %s/s",
                request.remote,
                allowed,
                decimal(int(self.min_download_rate)),
            )
            if request.transport is not None:
                request.transport.abort()
            raise web.HTTPRequestTimeout(text="the download was too slow") from None

    async def _serve_from_memory(self, request: web.Request, memory: MemoryCheckpoint) -> web.StreamResponse:
        """The file's bytes (a Range of them, as a file would answer) from θ_g in memory."""
        try:
            wanted = request.http_range
        except ValueError:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{memory.size}"}) from None
        start, stop = wanted.start, wanted.stop
        partial = start is not None or stop is not None
        if start is None:  # a suffix (bytes=-N) or no range at all
            start, stop = (memory.size - stop, memory.size) if stop is not None else (0, memory.size)
        elif start < 0:
            start, stop = memory.size + start, memory.size
        stop = memory.size if stop is None else min(stop, memory.size)
        if not 0 <= start < stop:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{memory.size}"})
        headers = {
            "X-Checkpoint-Sha256": memory.sha256,
            "X-Checkpoint-Step": str(memory.step),
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
        }
        if partial:
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{memory.size}"
        if memory.step not in self._from_memory:
            self._from_memory.add(memory.step)
            log.info("serving checkpoint %d from memory (no file of it is written)", memory.step)
        response = web.StreamResponse(status=206 if partial else 200, headers=headers)
        response.content_length = stop - start
        await response.prepare(request)
        for offset in range(start, stop, MEMORY_CHUNK):
            await response.write(memory.read(offset, min(MEMORY_CHUNK, stop - offset)))
        await response.write_eof()
        self.node.metrics.checkpoint_served.inc(stop - start)
        return response

    async def history(self, request: web.Request) -> web.Response:
        """The rounds after outer step `since` (all by default), oldest first, a page at a time."""
        since, limit = history_query(request.query)
        rounds = self.node.history.since(since, limit)
        body = await asyncio.to_thread(json.dumps, {"rounds": rounds, "more": len(rounds) == limit})
        return web.Response(text=body, content_type="application/json")

    async def dashboard(self, request: web.Request) -> web.Response:
        return web.Response(text=self._dashboard, content_type="text/html")
