"""Several real gRPC averaging servers on loopback in one event loop, for data-plane tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from dtnode.peers.butterfly import AllReduceReport, ChannelPool, butterfly_allreduce
from dtnode.peers.plan import INT8, Member, make_plan
from dtnode.peers.reducer import AveragingService, ReductionRegistry
from dtnode.peers.wire import max_message_bytes
from dtnode.peers.server import start_grpc_server


@dataclass
class Peer:
    member: Member
    registry: ReductionRegistry
    server: object
    channels: ChannelPool


async def start_peers(n: int, run_id: str = "test-run", client_mode: tuple[int, ...] = (),
                      chunk_elements: int = 1 << 12, bandwidths: list[float] | None = None) -> list[Peer]:
    peers = []
    for i in range(n):
        registry = ReductionRegistry()
        service = AveragingService(registry, run_id, registration_wait=2.0)
        server, port = await start_grpc_server(service, "127.0.0.1", 0, max_message_bytes(chunk_elements))
        member = Member(f"peer{i:02d}", f"127.0.0.1:{port}", client_mode=i in client_mode,
                        bandwidth=bandwidths[i] if bandwidths else 1.0)
        peers.append(Peer(member, registry, server, ChannelPool(max_message_bytes(chunk_elements))))
    return peers


async def stop_peers(peers: list[Peer]) -> None:
    for p in peers:
        await p.channels.close()
        await p.server.stop(None)


async def allreduce(peers: list[Peer], values: list[torch.Tensor], weights: list[float], *, run_id: str = "test-run",
                    round: int = 0, block_size: int = 64, chunk_elements: int = 1 << 12, codec: int = INT8,
                    timeout: float = 10.0) -> tuple[list[torch.Tensor], list[AllReduceReport]]:
    plan = make_plan(run_id, round, 0, [p.member for p in peers], values[0].numel(), block_size, chunk_elements, codec)
    outs = [torch.empty_like(v) for v in values]
    reports = await asyncio.gather(*(
        butterfly_allreduce(plan, p.member.peer_id, v, w, o, p.registry, p.channels, timeout)
        for p, v, w, o in zip(peers, values, weights, outs)
    ))
    return outs, list(reports)
