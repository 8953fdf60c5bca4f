"""Swarm key: who may average with us, register in our groups, or download our state.

Every member of a closed swarm holds the same secret key. A peer proves it holds the key
with an HMAC-SHA256 tag over what it is doing (a gRPC stream for one part of one round, a
checkpoint download of one path, a group registration), its own peer id and a timestamp;
tags are accepted within a short window and each only once, so a captured tag cannot be
replayed. The key never travels. Without a key the swarm is open, and the node says so.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

ENV_KEY = "DTNODE_SWARM_KEY"
MIN_KEY_BYTES = 16
WINDOW_S = 60.0  # clock skew plus the longest delay a tag may see before use


class AuthError(ValueError):
    """A missing, malformed, stale, replayed or forged tag."""


def load_swarm_key(path: str | None, env: Mapping[str, str] | None = None) -> bytes | None:
    """The key from `--swarm-key-file` or DTNODE_SWARM_KEY; None means an open swarm."""
    env = os.environ if env is None else env
    if path:
        try:
            raw = Path(path).read_bytes().strip()
        except OSError as e:
            raise AuthError(f"cannot read the swarm key file {path}: {e.strerror or e}") from None
    elif env.get(ENV_KEY):
        raw = env[ENV_KEY].strip().encode()
    else:
        return None
    if len(raw) < MIN_KEY_BYTES:
        raise AuthError(f"the swarm key must be at least {MIN_KEY_BYTES} bytes (try `openssl rand -hex 32`)")
    return hashlib.sha256(b"dtnode-swarm-key\0" + raw).digest()


class SwarmAuth:
    """Issues and checks tags for one swarm key."""

    def __init__(self, key: bytes, peer_id: str, window: float = WINDOW_S, remember: int = 65536):
        self.key = key
        self.peer_id = peer_id
        self.window = window
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._remember = remember

    def _mac(self, purpose: str, peer_id: str, subject: str, timestamp: str) -> str:
        message = f"{purpose}\0{peer_id}\0{subject}\0{timestamp}".encode()
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def issue(self, purpose: str, subject: str) -> str:
        """A tag `peer_id.timestamp.mac` for this node doing `purpose` on `subject`."""
        timestamp = str(int(time.time() * 1000))  # milliseconds: no dot to confuse the split
        return f"{self.peer_id}.{timestamp}.{self._mac(purpose, self.peer_id, subject, timestamp)}"

    def verify(
        self,
        purpose: str,
        subject: str,
        tag: str | None,
        peer_id: str | None = None,
        single_use: bool = True,
        max_age: float | None = -1.0,
    ) -> str:
        """Check a tag; returns the peer id it was issued by. `peer_id` pins who must have issued it.

        Tags on records that many peers read for a while (registrations, membership) are
        checked with `single_use=False` and `max_age=None`: their subject already names the
        round, hop or record they belong to, so they cannot be moved elsewhere.
        """
        if not tag or len(tag) > 512:
            raise AuthError("missing swarm key tag")
        try:
            issuer, timestamp, mac = tag.rsplit(".", 2)
            if not timestamp.isdigit() or len(timestamp) > 16:
                raise ValueError
            issued_at = int(timestamp) / 1000
        except ValueError:
            raise AuthError("malformed swarm key tag") from None
        if peer_id is not None and issuer != peer_id:
            raise AuthError("tag issued by another peer")
        max_age = self.window if max_age == -1.0 else max_age
        if issued_at - time.time() > self.window or (max_age is not None and time.time() - issued_at > max_age):
            raise AuthError("stale swarm key tag")
        if not hmac.compare_digest(mac, self._mac(purpose, issuer, subject, timestamp)):
            raise AuthError("invalid swarm key tag")
        if single_use:
            self._forget_old()
            if mac in self._seen:
                raise AuthError("replayed swarm key tag")
            self._seen[mac] = issued_at
        return issuer

    def _forget_old(self) -> None:
        horizon = time.time() - self.window
        while self._seen and (len(self._seen) >= self._remember or next(iter(self._seen.values())) < horizon):
            self._seen.popitem(last=False)


def stream_subject(run_id: str, round: int, hop: int, group_id: bytes, part: int) -> str:
    """What a gRPC stream's tag covers: one part of one group's round."""
    return f"{run_id}/{round}/{hop}/{group_id.hex()}/{part}"


GRPC_METADATA = "x-dtnode-auth"
HTTP_HEADER = "X-Dtnode-Auth"
