"""How a node reaches its swarm: the DHT started through `--peer` and the peers it knew, the
address it announces, and the peers it remembers for its next start (its credentials:
`credentials.py`).

A restarted node whose `--peer` is down, or is its own old address (the swarm's first node),
still finds the swarm through any peer it saw before (`known-peers.json` in its state dir),
and keeps the DHT port its peers know when that port is free.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import shlex
import socket
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from dtnode.daemon.config.model_source import is_hub_id
from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.swarm.credentials import IDENTITY_FILE
from dtnode.daemon.telemetry.metrics import NodeMetrics
from dtnode.daemon.workload.recipe import SwarmRecipe, recipe_flags
from dtnode.peers.dht_in_process import InProcessDHT, SwarmDHT
from dtnode.peers.dht_start import public_maddrs, start_dht
from dtnode.peers.hivemind_adapter import RSASignatureValidator
from dtnode.peers.known_peers import FILE_NAME as KNOWN_PEERS_FILE
from dtnode.peers.known_peers import KnownPeers, peer_of
from dtnode.peers.membership import JoinError, Membership, PeerRecord
from dtnode.peers.sidecar_address import PROBE_TIMEOUT_S, SidecarAddressError, is_sidecar_address, resolve_peers

log = logging.getLogger("dtnode")

DHT_PORT_FILE = "dht-port"  # the DHT port of the last run, reused when free (--dht-port 0)
REMEMBER_PEERS_EVERY_S = 5.0
MAX_PEERS_SEEN = 1 << 16
REDIAL_KNOWN_PEERS = 8  # known peers an isolated node redials each heartbeat (besides --peer)
MAX_DHT_ADDRS = 4  # multiaddrs a record carries


class DhtBootstrap:
    def __init__(self, settings: NodeSettings, state_dir: Path):
        self.settings = settings
        self.state_dir = state_dir
        self.known_peers = KnownPeers(state_dir / KNOWN_PEERS_FILE)

    async def start(
        self, peer_id: str, fresh_identity: bool, validator: RSASignatureValidator
    ) -> tuple[InProcessDHT, list[str]]:
        """Join the DHT through --peer and the peers this node knew, never itself; returns the
        DHT and the addresses an isolated node redials.

        The first node of a swarm (no --peer other than itself) whose known peers are all gone
        starts alone and keeps dialling them; a node given --peer that reaches nobody ends
        with the list it tried."""
        s = self.settings
        identity = (self.state_dir / IDENTITY_FILE).resolve()
        own = peer_id or None
        self.known_peers = await asyncio.to_thread(self.known_peers.load)
        given = await self._resolve_sidecar_peers(own)
        named = [a for a in given if own is None or peer_of(a) != own]
        if len(named) < len(given):
            log.info(
                "--peer %s is this node's own address: joining through the peers it knew instead",
                next(a for a in given if a not in named),
            )
        known = [a for a in self.known_peers.addresses(exclude=own) if a not in named]
        port = s.network.dht_port or await asyncio.to_thread(self._previous_dht_port)
        start = partial(
            start_dht,
            host=s.network.host,
            port=port,
            announce_host=s.network.announce_host,
            timeout=s.swarm.join_timeout,
            identity_path=str(identity),
            validator=validator,
            fresh_identity=fresh_identity,
            client_mode=s.network.client_mode,
        )
        try:
            # the peers it knew may all be gone: only --peer is dialled until --join-timeout
            return await start(named + known, keep_trying=bool(named)), named + self._redial(own)
        except JoinError as e:
            if not known:
                raise
            tried = (
                f"{len({peer_of(a) for a in known})} peer(s) it knew ({', '.join(known[:3])}"
                f"{', ...' if len(known) > 3 else ''})"
            )
            if named:
                raise JoinError(f"could not join through --peer {', '.join(named)} nor the {tried}: {e}") from None
            log.warning("none of the %s answered (%s); starting alone and dialling them until they do", tried, e)
            return await start([]), self._redial(own)

    async def _resolve_sidecar_peers(self, own: str | None) -> list[str]:
        """--peer with each sidecar address (http://HOST:PORT) replaced by that node's multiaddrs.
        A node that knew peers before goes on without a sidecar that does not answer."""
        s = self.settings
        if not any(is_sidecar_address(p) for p in s.swarm.peers):
            return list(s.swarm.peers)
        knows_peers = bool(self.known_peers.addresses(exclude=own))
        try:
            resolved = await resolve_peers(
                s.swarm.peers, min(s.swarm.join_timeout, PROBE_TIMEOUT_S) if knows_peers else s.swarm.join_timeout
            )
        except SidecarAddressError as e:
            if not knows_peers:
                raise JoinError(f"could not join through --peer: {e}") from None
            log.warning("%s; joining through the peers this node knew", e)
            return [p for p in s.swarm.peers if not is_sidecar_address(p)]
        log.info(
            "--peer %s: %s",
            ", ".join(p for p in s.swarm.peers if is_sidecar_address(p)),
            ", ".join(a for a in resolved if a not in s.swarm.peers),
        )
        return resolved

    def _redial(self, own: str | None) -> list[str]:
        """What an isolated node dials on each heartbeat besides --peer (one at a time, so few):
        the first address of each of the peers it knew most recently."""
        firsts = [
            addrs[0]
            for peer, (addrs, _) in sorted(self.known_peers.peers.items(), key=lambda i: -i[1][1])
            if peer != own
        ]
        return [a for a in firsts if a not in self.settings.swarm.peers][:REDIAL_KNOWN_PEERS]

    def _previous_dht_port(self) -> int:
        """The DHT port of this state dir's last run, if it is free: a restarted node keeps the
        address its peers (and their --peer flags) know. 0 (any) otherwise."""
        try:
            port = int((self.state_dir / DHT_PORT_FILE).read_text().strip())
        except (OSError, ValueError):
            return 0
        if not 0 < port < 65536:
            return 0
        with socket.socket(socket.AF_INET6 if ":" in self.settings.network.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.settings.network.host, port))
            except OSError:
                return 0
        return port

    def remember_dht_port(self, dht_addrs: tuple[str, ...]) -> None:
        ports = [m.group(1) for addr in dht_addrs if (m := re.search(r"/tcp/(\d+)", addr))]
        if ports:
            (self.state_dir / DHT_PORT_FILE).write_text(ports[0])


def dialable_addrs(dht: SwarmDHT, announce_host: str | None) -> tuple[str, ...]:
    """The multiaddrs this node's record announces (never a wildcard address)."""
    return tuple(a for a in public_maddrs(dht, announce_host) if "/0.0.0.0/" not in a and "/::/" not in a)[
        :MAX_DHT_ADDRS
    ]


def announce_host(settings: NodeSettings, dht: SwarmDHT) -> str:
    """The host peers dial this node's gRPC and HTTP at: --announce-host, the listening host,
    or the first non-loopback IPv4 address the DHT listens on."""
    if settings.network.announce_host:
        return settings.network.announce_host
    if settings.network.host not in ("0.0.0.0", "::", ""):
        return settings.network.host
    for addr in public_maddrs(dht, None):
        parts = addr.split("/")
        if len(parts) > 2 and parts[1] == "ip4" and not parts[2].startswith("127.") and parts[2] != "0.0.0.0":
            return parts[2]
    return socket.gethostbyname("localhost")


def join_command(settings: NodeSettings, recipe: SwarmRecipe, maddr: str, public: bool = False) -> str:
    """The line another host pastes to join this swarm: the run, the model, and every flag of
    the recipe that is not the default (workload/recipe.py), --data included (each host its own copy).
    `public` (what /status shows anyone): local paths cut to their last name (the file each host
    brings a copy of), so that the node's file system is not on an open port."""
    s = settings

    def local(path: str) -> str:
        return Path(path).name if public else path

    words = ["dtnode", "join", "--peer", maddr]
    words += ["--run-id", s.swarm.run_id] if s.swarm.run_id != NodeSettings.default("run_id") else []
    if s.workload.model != NodeSettings.default("model"):
        hf_directory = s.workload.model.startswith("hf:") and not is_hub_id(s.workload.model[3:])
        words += [
            "--model",
            f"hf:{local(s.workload.model[3:])}" if hf_directory else s.workload.model,
        ]  # a Hub id as it is
    words += (
        ["--tokenizer", local(str(s.workload.tokenizer))] if s.workload.tokenizer is not None else []
    )  # every peer needs the same
    words += (
        ["--text-field", s.workload.text_field] if s.workload.data is not None and "text_field" in s.given() else []
    )
    words += recipe_flags(recipe, Path(local(str(s.workload.data))) if s.workload.data is not None else None)
    words += ["--max-rounds", str(s.diloco.max_rounds)] if s.diloco.max_rounds is not None else []  # the run's end
    return shlex.join(words)


async def remember_peers(
    membership: Membership,
    known: KnownPeers,
    peer_id: str,
    metrics: NodeMetrics,
    own_theta: Callable[[], tuple[int, str]] = lambda: (0, ""),
) -> None:
    """Keep the addresses of the peers seen, for the next start, and the peer gauges (every
    few heartbeats, until cancelled). `own_theta()`: this node's outer step and θ_g hash."""
    seen: set[str] = set()  # ids, for the metric (bounded by the swarm's size)
    while True:
        try:
            # a view that the pacer, matchmaking or the wait for --min-peers read lately serves: each
            # read brings every record back from each node it asks, and reading afresh each pass
            # made a third of what 31 nodes waiting for a 32nd read (issue 60)
            view = await membership.members(max_age=membership.complete_view_s())
            if len(seen) > MAX_PEERS_SEEN:  # an open swarm's churn: start counting again
                seen.clear()
            seen.update(view)
            metrics.peers_live.set(len(view.keys() | {peer_id}))
            metrics.peers_seen.set(len(seen | {peer_id}))
            metrics.theta_agreement.set(theta_agreement(own_theta(), view.values(), peer_id))
            known.remember(view.values(), peer_id)
            await asyncio.to_thread(known.save)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  (a full disk must not stop training; the next pass retries)
            log.warning("could not save the known peers: %s", e)
        await asyncio.sleep(REMEMBER_PEERS_EVERY_S)


def theta_agreement(own: tuple[int, str], records: Iterable[PeerRecord], peer_id: str) -> float:
    """The share of the live peers at this node's outer step, itself included, that announce
    its θ_g hash (NaN before it has one). A healthy swarm's groups leave it at 1; below one
    half, this node holds a θ_g most of its peers at its step do not."""
    step, theta = own
    if not theta:
        return math.nan
    others = [r.theta_sha256 for r in records if r.peer_id != peer_id and r.outer_step == step and r.theta_sha256]
    return (1 + sum(h == theta for h in others)) / (1 + len(others))
