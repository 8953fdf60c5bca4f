"""`--peer http://HOST:PORT`: join through a node's sidecar address instead of its multiaddr.

A multiaddr carries the peer id, which compose files, scripts and StatefulSets cannot know
before the first node has started. A sidecar address is known in advance (a service name
and a port); the node's `/status` names the DHT addresses to dial. What it answers is
untrusted: only a few well-formed multiaddrs are taken from it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_before_delay, wait_fixed

from .peer_address import is_peer_address

MAX_ADDRESSES = 8
MAX_STATUS_BYTES = 1 << 20
RETRY_S = 2.0
PROBE_TIMEOUT_S = 10.0  # the longest one ask of a peer's sidecar waits (its /status, a checkpoint's metadata)


class SidecarAddressError(ValueError):
    """A sidecar address that gave no usable multiaddr (unreachable, not a dtnode, malformed)."""


def is_sidecar_address(peer: str) -> bool:
    return peer.startswith(("http://", "https://"))


def _valid(addr: object) -> bool:
    return is_peer_address(addr)  # parsed whole: host, TCP port and a peer id that decodes


async def _resolve_one(session: aiohttp.ClientSession, url: str, timeout: float) -> list[str]:
    return _dht_addrs(url, await fetch_status(session, url, timeout))


async def fetch_status(session: aiohttp.ClientSession, url: str, timeout: float) -> dict[str, Any]:
    """A node's /status (untrusted: a JSON object, checked by the caller), asked until `timeout`:
    a node started beside its first peer (compose, a StatefulSet) may find that peer's sidecar
    not listening yet."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    retrying = AsyncRetrying(
        retry=retry_if_exception_type(SidecarAddressError),
        wait=wait_fixed(RETRY_S),
        stop=stop_before_delay(max(timeout - RETRY_S, 0.0)),
        reraise=True,
    )

    async def ask() -> dict[str, Any]:  # an async def: tenacity awaits coroutine functions only
        return await _ask(session, url, max(1.0, min(PROBE_TIMEOUT_S, deadline - loop.time())))

    return await retrying(ask)


async def _ask(session: aiohttp.ClientSession, url: str, timeout: float) -> dict[str, Any]:
    status_url = url.rstrip("/") + "/status"
    try:
        async with session.get(status_url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status == 404:
                raise SidecarAddressError(
                    f"{status_url} answered HTTP 404: that node serves its status privately (--status-port); "
                    "give its multiaddr instead"
                )
            if resp.status != 200:
                raise SidecarAddressError(f"{status_url} answered HTTP {resp.status}")
            status = json.loads(await resp.content.read(MAX_STATUS_BYTES))
    except SidecarAddressError:
        raise
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise SidecarAddressError(f"{status_url} is not reachable ({type(e).__name__}: {e})") from None
    except ValueError:
        raise SidecarAddressError(f"{status_url} did not answer a dtnode status") from None
    if not isinstance(status, dict):
        raise SidecarAddressError(f"{status_url} did not answer a dtnode status")
    return status


def _dht_addrs(url: str, status: dict[str, Any]) -> list[str]:
    addrs = status.get("dht_addrs")
    if not isinstance(addrs, list) or not (good := [a for a in addrs if _valid(a)][:MAX_ADDRESSES]):
        raise SidecarAddressError(
            f"{url.rstrip('/')}/status names no DHT address (is it a dtnode sidecar that has started?)"
        )
    return good


async def resolve_peers(peers: list[str], timeout: float) -> list[str]:
    """--peer values with each sidecar address replaced by that node's multiaddrs. Raises
    SidecarAddressError when every sidecar address given failed and no multiaddr was given."""
    sidecars = [p for p in peers if is_sidecar_address(p)]
    if not sidecars:
        return list(peers)
    out = [p for p in peers if not is_sidecar_address(p)]
    errors = []
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(
            *(_resolve_one(session, url, timeout) for url in sidecars), return_exceptions=True
        )
    for url, result in zip(sidecars, results):
        if isinstance(result, SidecarAddressError):
            errors.append(str(result))
        elif isinstance(result, BaseException):
            raise result
        else:
            out += [a for a in result if a not in out]
    if not out:
        raise SidecarAddressError("; ".join(errors))
    return out
