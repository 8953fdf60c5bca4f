"""A test's attacker, beside its rounds: the hostile points that act on other peers directly.

Armed only by `DTNODE_TEST_FAILPOINT` (peers/failpoints.py), for the security tests and the
hostile-peer benchmark (`tests.bench.hostile`); a node without it never starts any of this.
Each attack is what an outsider or a member could do with the project's own code and one
input changed:

- `hostile-shadow`: plain values, expiring in years, under the swarm's membership key and the
  group keys of the coming rounds (an outsider's plain hivemind DHT can store them);
- `hostile-pinning`: asks every peer's sidecar for its newest checkpoint and one byte of every
  step it serves, several times a second;
- `hostile-slots`: keeps `HOSTILE_STREAMS` averaging streams open to every peer, sending nothing;
- `hostile-donors`: Sybil records, each signed by a key of its own, announcing this node's
  (lying) checkpoint at other names of its sidecar's host.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from urllib.parse import urlsplit

import aiohttp

from dtnode.peers import failpoints
from dtnode.peers.channel_pool import ChannelPool
from dtnode.peers.dht_in_process import SwarmDHT
from dtnode.peers.grid import grid_shape
from dtnode.peers.hivemind_adapter import (
    CompositeValidator,
    DHTNode,
    RSAPrivateKey,
    RSASignatureValidator,
    get_dht_time,
)
from dtnode.peers.identity import peer_id_of_owner, signed_subkey
from dtnode.peers.membership import PeerRecord
from dtnode.proto import averaging_pb2 as pb

log = logging.getLogger("dtnode")

SHADOW_TTL_S = 1e7  # about four months
ROUNDS_AHEAD = 4  # group keys shadowed ahead of the round in progress
PIN_EVERY_S = 0.25
SLOTS_EVERY_S = 0.5
SYBILS = 5  # records beside the attacker's own: six votes for its file


def host_aliases(http_addr: str) -> list[str]:
    """Other names of a loopback sidecar's address (each once a separate vote): a name, and
    hexadecimal forms of 127.0.0.1 that an HTTP client takes for names and the resolver
    (inet_aton) reads as that address."""
    port = urlsplit(http_addr).port
    hosts = ("localhost", "0x7f000001", "0x7f.1", "0x7f.0.1", "0x7f.0.0.1")
    return [f"http://{host}:{port}" for host in hosts][:SYBILS]


async def run(
    dht: SwarmDHT,
    run_id: str,
    target_group_size: int,
    members: Callable[[], Awaitable[dict[str, PeerRecord]]],
    own: Callable[[], PeerRecord],
    channels: ChannelPool,
    interval: float,
    stopping: asyncio.Event,
) -> None:
    """The armed background attack, until the node stops (nothing when none is armed)."""
    attack = failpoints.armed()
    if attack not in ("hostile-shadow", "hostile-pinning", "hostile-slots", "hostile-donors"):
        return
    log.warning("test attacker: %s", attack)
    if attack == "hostile-shadow":
        body = _shadow(dht, run_id, target_group_size, members, own)
    elif attack == "hostile-pinning":
        body = _pin(members, own)
    elif attack == "hostile-slots":
        body = _hold_slots(members, own, channels)
    else:
        body = _sybil_donors(dht, run_id, own, interval)
    with contextlib.suppress(asyncio.CancelledError):
        waiting = asyncio.ensure_future(stopping.wait())
        attacking = asyncio.ensure_future(body)
        await asyncio.wait({waiting, attacking}, return_when=asyncio.FIRST_COMPLETED)
        for task in (waiting, attacking):
            task.cancel()
        await asyncio.gather(waiting, attacking, return_exceptions=True)


async def _shadow(
    dht: SwarmDHT,
    run_id: str,
    target: int,
    members: Callable[[], Awaitable[dict[str, PeerRecord]]],
    own: Callable[[], PeerRecord],
) -> None:
    stored: set[str] = set()
    while True:
        view = await members()
        side, dims = grid_shape(max(len(view), 1), target)
        step = own().outer_step
        keys = [f"{run_id}.peers"]
        for round_no in range(step, step + ROUNDS_AHEAD):
            for hop in range(dims):
                for cell in itertools.product(range(side), repeat=dims - 1):
                    key = f"{run_id}.group.{round_no}.{hop}.d{dims}.{'-'.join(map(str, cell)) or 'all'}"
                    keys += [key, f"{key}.closed", f"{key}.formed"]
        for key in keys:
            if key not in stored:
                stored.add(key)
                with contextlib.suppress(Exception):
                    await dht.store(key, "shadow", expiration_time=get_dht_time() + SHADOW_TTL_S, return_future=True)
        await asyncio.sleep(1.0)


async def _pin(members: Callable[[], Awaitable[dict[str, PeerRecord]]], own: Callable[[], PeerRecord]) -> None:
    me = own().peer_id
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            for record in (await members()).values():
                if record.peer_id == me or not record.http_addr.startswith("http"):
                    continue
                asks: list[tuple[str, dict[str, str]]] = [(f"{record.http_addr}/checkpoint", {})] + [
                    (f"{record.http_addr}/checkpoint/{served.split(':', 1)[0]}", {"Range": "bytes=0-0"})
                    for served in record.served
                ]
                for url, headers in asks:
                    with contextlib.suppress(Exception):
                        async with session.get(url, headers=headers) as resp:
                            await resp.read()
            await asyncio.sleep(PIN_EVERY_S)


async def _silence(never: asyncio.Event) -> AsyncIterator[pb.PartChunk]:
    await never.wait()
    yield pb.PartChunk()  # never reached


async def _hold_slots(
    members: Callable[[], Awaitable[dict[str, PeerRecord]]], own: Callable[[], PeerRecord], channels: ChannelPool
) -> None:
    me, never = own().peer_id, asyncio.Event()
    held: dict[str, set[asyncio.Task]] = {}

    async def hold(stub) -> None:
        with contextlib.suppress(Exception):
            async for _ in stub.Reduce(_silence(never)):
                pass

    while True:
        for record in (await members()).values():
            if record.peer_id == me or record.client_mode or not record.grpc_addr:
                continue
            tasks = held.setdefault(record.peer_id, set())
            tasks -= {t for t in tasks if t.done()}
            try:
                stub = channels.stub(record.grpc_addr, record.peer_id)
            except Exception as e:  # noqa: BLE001  (no certificate known yet: the next pass)
                log.debug("no stub for %s yet: %s", record.peer_id, e)
                continue
            while len(tasks) < failpoints.HOSTILE_STREAMS:
                tasks.add(asyncio.ensure_future(hold(stub)))
        await asyncio.sleep(SLOTS_EVERY_S)


async def _sybil_donors(dht: SwarmDHT, run_id: str, own: Callable[[], PeerRecord], interval: float) -> None:
    keys = [await asyncio.to_thread(RSAPrivateKey) for _ in range(SYBILS)]
    while True:
        record = own()
        entries = []
        for key, alias in zip(keys, host_aliases(record.http_addr), strict=False):
            owner = RSASignatureValidator(key).local_public_key
            sybil = peer_id_of_owner(owner)
            assert sybil is not None
            fake = record.model_copy(
                update={"peer_id": sybil, "http_addr": alias, "grpc_addr": "", "state": "stopped", "tls_sig": ""}
            )
            entries.append((key, signed_subkey(sybil, owner), fake.model_dump()))
        with contextlib.suppress(Exception):
            await dht.run_coroutine(
                partial(_store_signed, f"{run_id}.peers", entries, 3 * interval), return_future=True
            )
        await asyncio.sleep(interval)


async def _store_signed(key: str, entries: list, ttl: float, _dht: SwarmDHT, node: DHTNode) -> None:
    """Runs on the DHT node: each entry stored signed by a key of its own (the node signs
    only with its own, so the validator is swapped for each store)."""
    saved = node.protocol.record_validator
    try:
        for private_key, subkey, value in entries:
            node.protocol.record_validator = CompositeValidator([RSASignatureValidator(private_key)])
            await node.store(key, value, get_dht_time() + ttl, subkey=subkey)
    finally:
        node.protocol.record_validator = saved
