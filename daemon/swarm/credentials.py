"""A node's credentials: the RSA key that names it (its peer id) and signs its DHT records, the
swarm key's authenticator, and the data plane's TLS identity, derived from that same key.

The key is made here rather than by hivemind, so that the peer id is known before the DHT runs
(the model is built meanwhile, and a restarted node keeps its id). Each credential that is off
comes with the warning an operator must see: an open swarm, a plaintext data plane.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from dtnode.peers.auth import SwarmAuth
from dtnode.peers.hivemind_adapter import P2P, RSAPrivateKey, RSASignatureValidator, key_of
from dtnode.peers.identity import identity_key
from dtnode.peers.known_peers import own_peer_id
from dtnode.peers.tls import NodeIdentity, TrustStore

log = logging.getLogger("dtnode")

IDENTITY_FILE = "identity.key"  # the node's RSA key (hivemind's identity format), in its state dir
TLS_CERT_FILE = "tls.crt"  # this node's data-plane certificate (PEM), derived from its record key


@dataclass(frozen=True)
class NodeKey:
    """The key that names this peer, and the validator that signs its records with it."""

    record_key: RSAPrivateKey
    validator: RSASignatureValidator
    fresh: bool  # made by this start: hivemind's check that no live peer uses it is skipped
    peer_id: str  # "" where the file does not say it yet (the DHT names it)


async def node_key(state_dir: Path) -> NodeKey:
    """This peer's key from its state dir, made there on its first start."""
    identity = (state_dir / IDENTITY_FILE).resolve()
    fresh = not identity.exists()
    if fresh:
        await asyncio.to_thread(P2P.generate_identity, str(identity))
    # the key that names this peer also signs its records: readers check the one against the other
    record_key = await asyncio.to_thread(identity_key, identity)
    known_id = await asyncio.to_thread(own_peer_id, identity)
    return NodeKey(record_key, RSASignatureValidator(record_key), fresh, known_id or "")


def swarm_auth(key: bytes | None, peer_id: str) -> SwarmAuth | None:
    """The swarm key's authenticator, or None (an open swarm, said as a warning)."""
    if key is None:
        log.warning(
            "no swarm key (--swarm-key-file or DTNODE_SWARM_KEY): this swarm is open, anyone who can "
            "reach it may join its groups and download its checkpoints"
        )
        return None
    return SwarmAuth(key, peer_id)


async def data_plane_trust(
    insecure: bool, state_dir: Path, record_key: RSAPrivateKey, peer_id: str
) -> TrustStore | None:
    """The data plane's TLS identity, or None with --insecure-data-plane (said as a warning)."""
    if insecure:
        log.warning(
            "--insecure-data-plane: pseudo-gradients travel in plaintext; anyone on the path can read "
            "or alter them, and a swarm key holder can speak as another peer"
        )
        return None
    return await asyncio.to_thread(tls_identity, state_dir, record_key, peer_id)


def tls_identity(state_dir: Path, record_key: RSAPrivateKey, peer_id: str) -> TrustStore:
    """This node's TLS certificate, self-signed with its record key, kept in the state dir
    (operators can compare its fingerprint with the one peers log)."""
    identity = NodeIdentity.from_key(key_of(record_key), peer_id)
    path = state_dir / TLS_CERT_FILE
    if not path.exists() or path.read_bytes() != identity.cert_pem:
        path.write_bytes(identity.cert_pem)
    return TrustStore(identity, peer_id)
