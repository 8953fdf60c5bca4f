"""Network groups: which addresses count as one voice when peers vote.

Records are cheap to make, and names are cheaper: a wildcard DNS name gives an operator one
name per vote, an IPv6 /64 gives it 2^64 addresses, and `127.1`, `2130706433` and `0x7f000001`
all name 127.0.0.1. So a voter is the network group of the address its name resolves to, as
Bitcoin Core buckets its peers:

- a public IPv4 address by its /16, a public IPv6 address by its /32 (an IPv4-mapped IPv6
  address as the IPv4 address it maps);
- a private, shared, link-local or unique-local address (a LAN, a cluster's pod network, where
  an outsider cannot bring many addresses) by itself: each host votes;
- a loopback address by its port: only local processes listen there, several nodes of one
  machine (tests, `dtnode local`), each its own voice.

An operator's many hosts in one /16 then vote once: an honest swarm whose donors share one
provider's /16 counts fewer voices, which only matters when voices tie or a majority is needed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

IPV4_PREFIX = 16
IPV6_PREFIX = 32
RESOLVE_TIMEOUT_S = 5.0

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def network_group(ip: Address, port: int | None = None) -> str:
    """The group an address votes in (see the module)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return f"loopback:{port}"
    if ip.is_private or ip.is_link_local or (isinstance(ip, ipaddress.IPv4Address) and ip.is_reserved):
        return f"host:{ip}"
    prefix = IPV4_PREFIX if isinstance(ip, ipaddress.IPv4Address) else IPV6_PREFIX
    return f"net:{ipaddress.ip_network(f'{ip}/{prefix}', strict=False)}"


async def url_group(url: str) -> str | None:
    """The network group of the host an http(s) URL names, resolved as a connection would
    resolve it (its first address); None when it names none or does not resolve."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if not host:
        return None
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S
        )
    except (OSError, TimeoutError, UnicodeError):
        return None
    for _family, _type, _proto, _name, sockaddr in infos:
        try:
            return network_group(ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]), port)
        except ValueError:
            continue
    return None
