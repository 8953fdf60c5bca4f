"""Starting the node's DHT (hivemind's DHT node on the node's own loop: dht_in_process.py): its
orphans of a crashed run reaped, its initial peers dialled again until --join-timeout, and its
failures turned into one JoinError line. Also the multiaddrs others can dial.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import re
import socket
import time

import psutil

from . import failpoints
from .dht_in_process import InProcessDHT, SwarmDHT
from .dht_records import SwarmValidator
from .dht_requests import REPLICAS
from .hivemind_adapter import RSASignatureValidator
from .membership import JoinError

log = logging.getLogger(__name__)
# How hivemind says that no initial peer answered: p2pd could not connect, or it connected and the
# DHT behind it did not answer a ping in time (a busy first node of a 32-node swarm on one box:
# a joiner gave up at once although its --join-timeout had 15 minutes left)
NOT_ANSWERED = ("failed to connect to bootstrap peers", "none of the initial_peers responded to a ping")
BOOTSTRAP_RETRY_S = 2.0  # between a joiner's tries to reach its initial peers, within --join-timeout


def _proto(host: str) -> str:
    """The multiaddr protocol of a host: an IP literal, or a name to resolve (--announce-host node1)."""
    try:
        return "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
    except ValueError:
        return "dns"


def _maddr(host: str, port: int) -> str:
    return f"/{_proto(host)}/{host}/tcp/{port}"


def _reap_orphaned_daemons(identity_path: str) -> int:
    """Kill p2pd daemons that a crashed node left behind with our identity (orphans: their
    parent, the node, is gone)."""
    killed = 0
    marker = f"-id={identity_path}"
    for proc in psutil.process_iter(["name", "cmdline", "ppid"]):
        argv = proc.info.get("cmdline") or []
        if not argv or not argv[0].endswith("p2pd") or marker not in argv or proc.info.get("ppid") != 1:
            continue
        with contextlib.suppress(psutil.Error):
            proc.kill()
            killed += 1
    return killed


async def start_dht(
    initial_peers: list[str],
    host: str,
    port: int,
    announce_host: str | None,
    timeout: float,
    identity_path: str | None = None,
    validator: RSASignatureValidator | None = None,
    fresh_identity: bool = False,
    client_mode: bool = False,
    keep_trying: bool = True,
) -> InProcessDHT:
    """Start the DHT and reach the initial peers, or raise JoinError in bounded time.

    With `fresh_identity` (just generated) hivemind's check that no live peer uses it is skipped.
    With `client_mode` (behind NAT) the DHT only asks: other peers never store keys on it or
    route through it. An announced host needs a known port: port 0 becomes a free port first,
    so the announced address (hivemind's and the record's) carries the port that is bound.
    With `keep_trying`, initial peers that do not answer are dialled again until `timeout`."""
    for addr in initial_peers:
        if not addr.startswith("/") or "/p2p/" not in addr:
            raise JoinError(f"--peer {addr!r} is not a multiaddr like /ip4/1.2.3.4/tcp/7700/p2p/Qm...")
    host_maddrs = [_maddr(host, port)]
    announce_maddrs: list[str] | None = None
    validators: list[RSASignatureValidator | SwarmValidator] = []
    # a restarted node keeps its peer id (its identity file), and a crashed run's p2pd may hold it
    reaped = await asyncio.to_thread(_reap_orphaned_daemons, os.path.abspath(identity_path)) if identity_path else 0
    if reaped:
        log.warning("stopped the DHT daemon a crashed run of this node left behind")
        await asyncio.sleep(1.0)  # let the swarm notice it is gone
    if validator is not None:
        # the swarm's shapes, checked on store and on read; a test's outsider runs a plain DHT
        outsider = failpoints.armed() == "hostile-shadow"
        validators = [validator] if outsider else [SwarmValidator(validator)]
    if announce_host:
        port = port or free_port(host)
        host_maddrs = [_maddr(host, port)]
        announce_maddrs = [_maddr(announce_host, port)]
    deadline = time.monotonic() + timeout
    while True:
        left = max(deadline - time.monotonic(), 1.0)
        try:
            return await InProcessDHT.create(
                initial_peers=initial_peers,
                host_maddrs=host_maddrs,
                announce_maddrs=announce_maddrs,
                record_validators=validators,
                num_replicas=REPLICAS,
                client_mode=client_mode,
                identity_path=identity_path or None,
                check_if_identity_free=not fresh_identity,
                startup_timeout=left,
            )
        except TimeoutError:
            raise JoinError(
                f"no answer from the DHT or the initial peers within {timeout:.0f}s "
                f"(--join-timeout); are {initial_peers} reachable?"
            ) from None
        except Exception as e:  # noqa: BLE001  (hivemind reports daemon failures with several exception types)
            reason = _daemon_reason(e)
            redial = bool(initial_peers) and keep_trying and any(text in reason for text in NOT_ANSWERED)
            if redial and deadline - time.monotonic() > BOOTSTRAP_RETRY_S:
                # one dial that failed (the peer still starting, or too busy to answer in time)
                # is not the peer being gone: --join-timeout is how long to keep trying
                log.warning(
                    "could not reach %s yet (%s); trying again for up to %.0fs more (--join-timeout)",
                    ", ".join(initial_peers),
                    reason,
                    deadline - time.monotonic(),
                )
                await asyncio.sleep(BOOTSTRAP_RETRY_S)
                continue
            if initial_peers:
                tried = f" (dialled for {timeout:.0f}s, --join-timeout)" if redial else ""
                raise JoinError(f"could not join through {', '.join(initial_peers)}: {reason}{tried}") from None
            raise JoinError(f"could not start the DHT on {host}:{port}: {reason}") from None


def _daemon_reason(error: Exception) -> str:
    """The last line of a DHT start failure, without the timestamp hivemind's p2pd puts in it."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    return re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", text.splitlines()[-1])


def free_port(host: str) -> int:
    """A TCP port free on `host` now (for the DHT to bind a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def public_maddrs(dht: SwarmDHT, announce_host: str | None) -> list[str]:
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
        parts[1], parts[2] = _proto(announce_host), announce_host
        ranked.insert(0, "/".join(parts))
    return ranked
