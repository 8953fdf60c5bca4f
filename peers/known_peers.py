"""The peers a node has seen, kept in its state dir, so that a restart finds the swarm again.

`--peer` names one address, chosen when the node was first started. By the time the node
restarts, that peer may be down (in a StatefulSet every pod names pod 0, which restarts too)
or may be this very node (the swarm's first node, whose `--peer` is its own old address).
So each node remembers the DHT addresses its peers announced, newest first, bounded in
number and in age, and bootstraps from `--peer` together with them, skipping its own id.

The file is JSON, written atomically; addresses are checked to be multiaddrs ending in the
peer id of the record that announced them (a peer can only vouch for its own address).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

from .durable import write_durably
from .hivemind_adapter import PeerID

log = logging.getLogger(__name__)

FILE_NAME = "known-peers.json"
MAX_PEERS = 64
MAX_AGE_S = 7 * 24 * 3600.0
MAX_ADDRS_PER_PEER = 4
MAX_ADDR_CHARS = 256


def own_peer_id(identity_path: Path) -> str | None:
    """The peer id of the DHT identity kept in the state dir, before the DHT starts (None on a first start)."""
    try:
        return str(PeerID.from_identity(identity_path.read_bytes()))
    except Exception:  # noqa: BLE001  (missing, torn or foreign: hivemind makes or refuses it at start)
        return None


def peer_of(addr: str) -> str | None:
    """The peer id a multiaddr ends in (/.../p2p/<id>), or None if it names none."""
    parts = addr.rstrip("/").split("/")
    if len(parts) < 3 or parts[-2] != "p2p" or not addr.startswith("/"):
        return None
    return parts[-1] or None


def _valid(addr: object, peer_id: str) -> bool:
    return isinstance(addr, str) and 0 < len(addr) <= MAX_ADDR_CHARS and addr.isprintable() and peer_of(addr) == peer_id


class KnownPeers:
    """peer id -> (addresses, last seen in wall-clock seconds), persisted as JSON."""

    def __init__(self, path: Path, max_peers: int = MAX_PEERS, max_age_s: float = MAX_AGE_S):
        self.path = path
        self.max_peers = max_peers
        self.max_age_s = max_age_s
        self.peers: dict[str, tuple[tuple[str, ...], float]] = {}
        self._dirty = False

    def load(self) -> KnownPeers:
        """Read the file; a missing or malformed one (or entry) is skipped, never fatal."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return self
        except (OSError, ValueError) as e:
            log.warning("ignoring %s: %s", self.path, e)
            return self
        entries = raw.get("peers", {}) if isinstance(raw, dict) else {}
        for peer_id, entry in entries.items() if isinstance(entries, dict) else ():
            if not isinstance(entry, dict) or not isinstance(entry.get("seen"), (int, float)):
                continue
            addrs = tuple(a for a in entry.get("addrs", ()) if _valid(a, peer_id))[:MAX_ADDRS_PER_PEER]
            if addrs:
                self.peers[peer_id] = (addrs, float(entry["seen"]))
        self._trim(time.time())
        return self

    def remember(self, records: Iterable, own_id: str, now: float | None = None) -> None:
        """Note the addresses that live peers' records announce (each checked against its peer id)."""
        now = time.time() if now is None else now
        for record in records:
            if record.peer_id == own_id:
                continue
            addrs = tuple(a for a in record.dht_addrs if _valid(a, record.peer_id))[:MAX_ADDRS_PER_PEER]
            if addrs:
                previous = self.peers.get(record.peer_id)
                self.peers[record.peer_id] = (addrs, now)
                self._dirty |= previous is None or previous[0] != addrs or now - previous[1] > 60
        self._trim(now)

    def _trim(self, now: float) -> None:
        fresh = {p: e for p, e in self.peers.items() if now - e[1] <= self.max_age_s}
        newest = sorted(fresh.items(), key=lambda item: -item[1][1])[: self.max_peers]
        if len(newest) != len(self.peers):
            self._dirty = True
        self.peers = dict(newest)

    def addresses(self, exclude: str | None = None) -> list[str]:
        """Every remembered address, the most recently seen peers first."""
        ordered = sorted(self.peers.items(), key=lambda item: -item[1][1])
        return [a for peer_id, (addrs, _) in ordered if peer_id != exclude for a in addrs]

    def save(self) -> None:
        """Write the file if anything changed (atomically: a crash leaves the old one)."""
        if not self._dirty:
            return
        body = {"peers": {p: {"addrs": list(a), "seen": seen} for p, (a, seen) in self.peers.items()}}
        write_durably(self.path, [json.dumps(body, indent=1).encode()])
        self._dirty = False
