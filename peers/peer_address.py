"""A peer's multiaddr (`/ip4/1.2.3.4/tcp/7700/p2p/Qm...`), checked before anything dials it.

A multiaddr reaches us from a user's `--peer`, a config file, and a peer's `/status` (untrusted).
libp2p's daemon answers a malformed one after its dial timeout with a Go error ("multihash
length inconsistent"), and hivemind's own parser takes seconds to import: this one is small,
strict and immediate, and says what a valid address looks like. It accepts what dtnode nodes
announce and what users paste: an IPv4, IPv6 or DNS host, a TCP port, and a peer id, written as
a base58 multihash (`Qm...`: sha2-256; `12D3KooW...`: an identity hash of an Ed25519 key).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from enum import StrEnum

import base58

EXAMPLE = "/ip4/203.0.113.7/tcp/7700/p2p/QmQRUdNjhvgreSjaK29cZzbpN4uZbLwShCFzQvGncCmjDx"
MAX_CHARS = 300
_DNS_NAME = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$"
)
SHA2_256, IDENTITY = 0x12, 0x00
MAX_IDENTITY_DIGEST = 42  # libp2p inlines public keys of at most 42 bytes (Ed25519's is 36 as a protobuf)


class HostKind(StrEnum):
    IP4 = "ip4"
    IP6 = "ip6"
    DNS = "dns"
    DNS4 = "dns4"
    DNS6 = "dns6"


class PeerAddressError(ValueError):
    """A multiaddr that is not one a dtnode node can dial; the message says what is wrong."""

    def __init__(self, address: str, problem: str):
        shown = address if len(address) <= 80 else address[:77] + "..."
        super().__init__(f"{shown!r} is not a peer address: {problem} (a valid one looks like {EXAMPLE})")


@dataclass(frozen=True)
class PeerAddress:
    kind: HostKind
    host: str
    port: int
    peer_id: str

    def __str__(self) -> str:
        return f"/{self.kind}/{self.host}/tcp/{self.port}/p2p/{self.peer_id}"


def parse_peer_address(address: str) -> PeerAddress:
    """The parts of `/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT/p2p/PEER_ID`, or PeerAddressError."""
    if not isinstance(address, str):
        raise PeerAddressError(repr(address), "not text")
    if len(address) > MAX_CHARS or not address.isascii():
        raise PeerAddressError(address, f"longer than {MAX_CHARS} characters or not ASCII")
    parts = address.split("/")
    if len(parts) != 7 or parts[0] != "":
        raise PeerAddressError(address, "a multiaddr has six parts: /KIND/HOST/tcp/PORT/p2p/PEER_ID")
    _, kind_name, host, transport, port_text, p2p, peer_id = parts
    try:
        kind = HostKind(kind_name)
    except ValueError:
        raise PeerAddressError(address, f"unknown host kind {kind_name!r}; use ip4, ip6, dns, dns4 or dns6") from None
    _check_host(address, kind, host)
    if transport != "tcp":
        raise PeerAddressError(address, f"the transport is {transport!r}; dtnode dials tcp")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise PeerAddressError(address, f"the port {port_text!r} is not a number from 1 to 65535")
    if p2p != "p2p":
        raise PeerAddressError(address, f"expected /p2p/PEER_ID after the port, found /{p2p}/")
    check_peer_id(address, peer_id)
    return PeerAddress(kind, host, int(port_text), peer_id)


def _check_host(address: str, kind: HostKind, host: str) -> None:
    if kind in (HostKind.IP4, HostKind.IP6):
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise PeerAddressError(address, f"{host!r} is not an {kind} address") from None
        if ip.version != (4 if kind == HostKind.IP4 else 6):
            raise PeerAddressError(address, f"{host!r} is not an {kind} address")
    elif not _DNS_NAME.match(host):
        raise PeerAddressError(address, f"{host!r} is not a DNS name")


def check_peer_id(address: str, peer_id: str) -> None:
    """A base58btc multihash: sha2-256 of 32 bytes, or an inlined (identity) key."""
    if not peer_id:
        raise PeerAddressError(address, "the peer id after /p2p/ is empty")
    try:
        raw = base58.b58decode(peer_id)
    except ValueError:
        raise PeerAddressError(
            address, f"the peer id {peer_id[:16]!r}... is not base58 (Qm... or 12D3KooW...)"
        ) from None
    code, length, digest = (raw[0], raw[1], raw[2:]) if len(raw) >= 2 else (-1, -1, b"")
    if code == SHA2_256 and length == 32 == len(digest):
        return
    if code == IDENTITY and length == len(digest) <= MAX_IDENTITY_DIGEST:
        return
    if peer_id.startswith(("Qm", "12D3KooW")):
        raise PeerAddressError(address, "the peer id is cut short or mistyped (copy it whole)")
    raise PeerAddressError(address, "the peer id is not a libp2p peer id (Qm... or 12D3KooW...)")


def is_peer_address(address: object) -> bool:
    try:
        parse_peer_address(address)  # type: ignore[arg-type]
    except PeerAddressError:
        return False
    return True
