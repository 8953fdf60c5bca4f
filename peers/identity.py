"""A peer id bound to the key that signs its records.

A libp2p peer id is the sha256 multihash of its RSA public key. A node signs its DHT records
with that same key (its identity key, `state-dir/identity.key`), and its records are filed
under a subkey naming the public key (hivemind's `[owner:...]` marker, whose signature the
DHT's validator checks). A reader recomputes the peer id from that public key: a record for
peer X is accepted only under X's own key. Nobody can file a record for an id they do not hold
the key of, whatever order records are seen in, and a record with no owner key is no record.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from .hivemind_adapter import PeerID, RSAPrivateKey, RSASignatureValidator, crypto_pb2, signing_key

OWNER_PREFIX, OWNER_SUFFIX = RSASignatureValidator.PUBLIC_KEY_FORMAT.split(b"_key_")


def identity_key(identity_path: Path) -> RSAPrivateKey:
    """The RSA key of a libp2p identity file (what `P2P.generate_identity` writes): the key
    that both names the peer and signs its records."""
    stored = crypto_pb2.PrivateKey.FromString(identity_path.read_bytes())
    if stored.key_type != crypto_pb2.RSA:
        raise ValueError(f"{identity_path} holds a {crypto_pb2.KeyType.Name(stored.key_type)} key, not RSA")
    key = serialization.load_der_private_key(stored.data, password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{identity_path} does not hold an RSA private key")  # noqa: TRY004  (a bad file, as above)
    return signing_key(key)


@lru_cache(maxsize=4096)
def owner_public_key(owner: bytes) -> rsa.RSAPublicKey | None:
    """The RSA public key an `[owner:ssh-rsa ...]` marker names (None if it names none)."""
    if not (owner.startswith(OWNER_PREFIX) and owner.endswith(OWNER_SUFFIX)):
        return None
    try:
        public = serialization.load_ssh_public_key(owner[len(OWNER_PREFIX) : -len(OWNER_SUFFIX)])
    except (ValueError, TypeError):
        return None
    return public if isinstance(public, rsa.RSAPublicKey) else None


@lru_cache(maxsize=4096)
def peer_id_of_owner(owner: bytes) -> str | None:
    """The peer id whose key an `[owner:ssh-rsa ...]` marker names (None if it names none)."""
    public = owner_public_key(owner)
    if public is None:
        return None
    encoded = crypto_pb2.PublicKey(
        key_type=crypto_pb2.RSA,
        data=public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo),
    ).SerializeToString()
    return str(PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))))


def signed_subkey(peer_id: str, owner: bytes) -> bytes:
    """The DHT subkey of an entry `peer_id` writes with the key `owner` names: the validator
    makes only that key's holder able to write it, and readers check it names `peer_id`'s key."""
    return peer_id.encode() + owner


def _split(subkey: object) -> tuple[str, bytes] | None:
    """A signed subkey's peer id and owner marker, unchecked (None if it has no marker)."""
    if isinstance(subkey, str):
        subkey = subkey.encode()
    if not isinstance(subkey, bytes) or len(subkey) > 4096:
        return None
    at = subkey.find(OWNER_PREFIX)
    if at <= 0:
        return None
    try:
        return subkey[:at].decode("ascii"), subkey[at:]
    except UnicodeDecodeError:
        return None


def writer_of(subkey: object) -> str | None:
    """The peer id a signed subkey's entry belongs to, if its owner key is that peer's own
    (None for a plain subkey, a malformed one, or a key of another peer)."""
    parts = _split(subkey)
    if parts is None:
        return None
    peer_id, owner = parts
    return peer_id if peer_id_of_owner(owner) == peer_id else None


def writer_key(subkey: object) -> rsa.RSAPublicKey | None:
    """The public key a signed subkey names, if it is its peer's own (as `writer_of`): the key
    that signed the entry, and that the peer's TLS certificate is made with (tls.py)."""
    parts = _split(subkey)
    if parts is None or peer_id_of_owner(parts[1]) != parts[0]:
        return None
    return owner_public_key(parts[1])
