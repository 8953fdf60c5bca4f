"""Several real gRPC averaging servers on loopback in one event loop, for data-plane tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch
from cryptography.hazmat.primitives.asymmetric import rsa

from dtnode.peers.allreduce_report import AllReduceReport
from dtnode.peers.butterfly import butterfly_allreduce
from dtnode.peers.channel_pool import ChannelPool
from dtnode.peers.part_codec import Feedback
from dtnode.peers.plan import INT8, Member, make_plan
from dtnode.peers.reduction_registry import ReductionRegistry
from dtnode.peers.server import start_grpc_server
from dtnode.peers.service import AveragingService
from dtnode.peers.tls import NodeIdentity, TrustStore, encode_certificate
from dtnode.peers.wire import max_message_bytes
from dtnode.proto import averaging_pb2_grpc as pb_grpc

T = TypeVar("T")


@dataclass
class Peer:
    member: Member
    registry: ReductionRegistry
    server: object
    channels: ChannelPool
    service: AveragingService


def tls_stores(peer_ids: list[str]) -> list[TrustStore]:
    """One trust store per peer, each knowing every peer's certificate (as after reading their records)."""
    stores = [TrustStore(NodeIdentity.from_key(rsa.generate_private_key(65537, 2048), p), p) for p in peer_ids]
    for store in stores:
        for peer_id, other in zip(peer_ids, stores):
            store.learn(peer_id, encode_certificate(other.own.cert_der))
    return stores


async def start_peers(
    n: int,
    run_id: str = "test-run",
    client_mode: tuple[int, ...] = (),
    chunk_elements: int = 1 << 12,
    bandwidths: list[float] | None = None,
    tls: bool = False,
) -> list[Peer]:
    peers = []
    ids = [f"peer{i:02d}" for i in range(n)]
    stores: list[TrustStore | None] = tls_stores(ids) if tls else [None] * n
    for i, (peer_id, trust) in enumerate(zip(ids, stores)):
        registry = ReductionRegistry()
        service = AveragingService(registry, run_id, registration_wait=2.0, trust=trust)
        server, port = await start_grpc_server(
            service,
            "127.0.0.1",
            0,
            max_message_bytes(chunk_elements),
            credentials=trust.server_credentials() if trust else None,
        )
        member = Member(
            peer_id, f"127.0.0.1:{port}", client_mode=i in client_mode, bandwidth=bandwidths[i] if bandwidths else 1.0
        )
        peers.append(Peer(member, registry, server, ChannelPool(max_message_bytes(chunk_elements), trust), service))
    return peers


async def stop_peers(peers: list[Peer]) -> None:
    for p in peers:
        await p.channels.close()
        await p.server.stop(None)


async def allreduce(
    peers: list[Peer],
    values: list[torch.Tensor],
    weights: list[float],
    *,
    run_id: str = "test-run",
    round: int = 0,
    hop: int = 0,
    block_size: int = 64,
    chunk_elements: int = 1 << 12,
    codec: int = INT8,
    timeout: float = 10.0,
    members: list[Member] | None = None,
    top_k: int = 0,
    feedback: list[Feedback] | None = None,
    in_place: bool = False,
) -> tuple[list[torch.Tensor], list[AllReduceReport]]:
    """One all-reduce among `peers`; `members` overrides the plan's member list (addresses a
    test reroutes, or a member that is not there); `in_place`: each result in its own values,
    as a node takes it."""
    plan = make_plan(
        run_id,
        round,
        hop,
        members or [p.member for p in peers],
        values[0].numel(),
        block_size,
        chunk_elements,
        codec,
        top_k=top_k,
    )
    outs = values if in_place else [torch.empty_like(v) for v in values]
    feedbacks: list[Feedback | None] = list(feedback) if feedback else [None] * len(peers)
    reports = await asyncio.gather(
        *(
            butterfly_allreduce(plan, p.member.peer_id, v, w, o, p.registry, p.channels, timeout, feedback=f)
            for p, v, w, o, f in zip(peers, values, weights, outs, feedbacks)
        )
    )
    return outs, list(reports)


async def send_stream(address: str, chunks: list, timeout: float = 5.0) -> grpc.StatusCode:
    """One Reduce stream of the given chunks, as an outsider opens it; the status it ended with."""
    async with grpc.aio.insecure_channel(address) as channel:
        return await stream_status(pb_grpc.AveragingStub(channel).Reduce(iter(chunks), timeout=timeout))


async def send_to_each_reducer(plan, peers: list[Peer], chunk_for) -> list[grpc.StatusCode]:
    """An outsider's one-chunk stream to each peer's part, `chunk_for(part, length)`; the statuses."""
    codes = []
    for peer in peers:
        part = plan.index_of(peer.member.peer_id)
        codes.append(await send_stream(peer.member.grpc_addr, [chunk_for(part, plan.parts[part][1])]))
    return codes


async def allreduce_beside(plan, peers: list[Peer], values, outs, beside: Awaitable[T]) -> tuple[list, T]:
    """Every peer's all-reduce over `plan` (no feedback, weight 1) while `beside` (an attacker)
    runs; the peers' reports and what `beside` returned."""
    *reports, other = await asyncio.gather(
        *(
            butterfly_allreduce(plan, p.member.peer_id, v, 1.0, o, p.registry, p.channels, timeout=5.0)
            for p, v, o in zip(peers, values, outs)
        ),
        beside,
    )
    return list(reports), other


async def stream_status(call) -> grpc.StatusCode:
    """Read a Reduce call to its end; the status it ended with (OK if none was raised)."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK
