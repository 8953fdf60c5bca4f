"""Data-plane benchmark: our int8/sparse/fp32 butterfly all-reduce against gloo and hivemind.

    .venv/bin/python -m tests.bench.allreduce            # 2 and 4 peers; 10, 100, 400 MB
    .venv/bin/python -m tests.bench.allreduce --peers 4 --sizes-mb 100 --reps 5

Every peer is its own process on loopback, all systems average the same per-peer buffers
in the same run (ours-robust: int8 with the trimmed-mean reducer, to price robust mode;
ours-int8-hop1: int8 as a later moshpit hop averages, whose reducers add in a fixed order;
ours-sparse: --compression sparse, top 64 of every 4,096 values with 2-bit values, its error
measured against the exact mean of what the peers kept, as the rest waits in their error-feedback
buffers; `-tls`: over mutual TLS pinned to each peer's certificate, as nodes run by default).
Wall time is the slowest peer's, median over `--reps` runs, started
together behind a gloo barrier; matchmaking is excluded for hivemind (its step is armed,
then triggered when the group is formed) as it is for ours. Error is relative L2 against
the exact mean (gloo's fp32 sum over n: exact to fp32 rounding). Bytes are payload bytes all peers sent:
counted for ours, by the algorithm's formula for gloo's ring and hivemind's butterfly.
A second table compares int8 and sparse coding throughput with a memcpy of the same buffer.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

SYSTEMS = (
    "ours-int8",
    "ours-int8-hop1",
    "ours-int8-tls",
    "ours-sparse",
    "ours-fp32",
    "ours-fp32-tls",
    "ours-robust",
    "gloo",
    "hivemind",
)
SPARSE_BLOCK, SPARSE_K = 4096, 64


def _barrier_time(t: float) -> float:
    """Slowest peer's duration (every peer returns it)."""
    value = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _sum_over_peers(x: float) -> float:
    value = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(value)
    return float(value)


def _rel_error(result: torch.Tensor, exact: torch.Tensor) -> float:
    local = torch.tensor([float((result - exact).norm()) ** 2, float(exact.norm()) ** 2], dtype=torch.float64)
    dist.all_reduce(local)
    return float((local[0] / local[1]).sqrt() / 1.0)


def _worker(rank: int, n: int, numel: int, reps: int, port: int, systems: tuple[str, ...], results) -> None:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    mp.set_start_method("fork", force=True)  # hivemind's averager is a forked mp.Process
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // n))
    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    exact = values.clone()  # fp32 reference (fp64 would cost 2x the buffer in every peer at 400 MB)
    dist.all_reduce(exact)
    exact /= n
    row: dict[str, dict] = {}
    import gc

    if "gloo" in systems:
        buf = torch.empty_like(values)
        times = []
        for _ in range(reps):
            buf.copy_(values)
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            buf /= n
            times.append(_barrier_time(time.perf_counter() - t))
        row["gloo"] = {"s": statistics.median(times), "bytes": 2 * (n - 1) * numel * 4, "err": _rel_error(buf, exact)}
        del buf
        gc.collect()

    for name in ("int8", "int8-hop1", "int8-tls", "sparse", "fp32", "fp32-tls", "robust"):
        if f"ours-{name}" in systems:
            row[f"ours-{name}"] = asyncio.run(_ours(rank, n, values, exact, reps, store, name))

    if "hivemind" in systems:
        row["hivemind"] = _hivemind(rank, n, values, exact, reps, store)
    if rank == 0:
        results.put(row)
    dist.barrier()
    dist.destroy_process_group()


async def _ours(rank, n, values, exact, reps, store, codec_name) -> dict:
    from dtnode.ops import sparse
    from dtnode.ops.quantization import use_fused_kernels
    from dtnode.peers.butterfly import butterfly_allreduce
    from dtnode.peers.channel_pool import ChannelPool
    from dtnode.peers.plan import FP32, INT8, SPARSE, Member, make_plan
    from dtnode.peers.reduction_registry import ReductionRegistry
    from dtnode.peers.server import start_grpc_server
    from dtnode.peers.service import AveragingService
    from dtnode.peers.wire import max_message_bytes

    use_fused_kernels(True)
    chunk = 1 << 20
    registry = ReductionRegistry()
    trust = None
    if codec_name.endswith("-tls"):  # mutual TLS pinned to each peer's certificate, as nodes run by default
        from cryptography.hazmat.primitives.asymmetric import rsa

        from dtnode.peers.tls import NodeIdentity, TrustStore, encode_certificate

        trust = TrustStore(NodeIdentity.from_key(rsa.generate_private_key(65537, 2048), f"peer{rank}"), f"peer{rank}")
        store.set(f"cert-{codec_name}-{rank}", encode_certificate(trust.own.cert_der))
        for i in range(n):
            trust.learn(f"peer{i}", store.get(f"cert-{codec_name}-{i}").decode())
    server, port = await start_grpc_server(
        AveragingService(registry, "bench", trust=trust),
        "127.0.0.1",
        0,
        max_message_bytes(chunk),
        credentials=trust.server_credentials() if trust else None,
    )
    store.set(f"grpc-{codec_name}-{rank}", f"127.0.0.1:{port}")
    members = [Member(f"peer{i}", store.get(f"grpc-{codec_name}-{i}").decode()) for i in range(n)]
    channels = ChannelPool(max_message_bytes(chunk), trust)
    out = torch.empty_like(values)
    times, sent = [], []
    if codec_name == "sparse":  # the reference: the exact mean of what every peer kept
        exact = sparse.decode(sparse.encode(values, SPARSE_BLOCK, SPARSE_K))
        dist.all_reduce(exact)
        exact /= n
    codec = {"sparse": SPARSE, "fp32": FP32, "fp32-tls": FP32}.get(codec_name, INT8)
    block = SPARSE_BLOCK if codec == SPARSE else 256
    for r in range(reps + 1):  # the first run warms channels up and is not counted
        hop = 1 if codec_name.endswith("-hop1") else 0  # a later moshpit hop: its reducers add in a fixed order
        plan = make_plan(
            "bench", r, hop, members, values.numel(), block, chunk, codec, top_k=SPARSE_K if codec == SPARSE else 0
        )
        dist.barrier()
        t = time.perf_counter()
        report = butterfly_allreduce(
            plan,
            f"peer{rank}",
            values,
            1.0,
            out,
            registry,
            channels,
            timeout=300,
            trim_fraction=0.2 if codec_name == "robust" else None,
        )
        report = await report
        elapsed = time.perf_counter() - t
        assert not report.failed_parts, report.failed_parts
        wall = _barrier_time(elapsed)
        total_sent = _sum_over_peers(report.bytes_sent)
        if r:
            times.append(wall)
            sent.append(total_sent)
    err = _rel_error(out, exact)
    dist.barrier()
    await channels.close()
    await server.stop(None)
    return {"s": statistics.median(times), "bytes": statistics.median(sent), "err": err}


def _hivemind(rank, n, values, exact, reps, store) -> dict:
    import hivemind
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import NoCompression

    if rank == 0:
        dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        store.set("hivemind-maddr", str(dht.get_visible_maddrs()[0]))
    else:
        dht = hivemind.DHT(
            initial_peers=[store.get("hivemind-maddr").decode()], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
        )
    tensor = values.clone()
    averager = DecentralizedAverager(
        [tensor],
        dht,
        start=True,
        prefix="bench",
        target_group_size=n,
        min_group_size=n,
        min_matchmaking_time=1.0,
        request_timeout=0.5,
        allreduce_timeout=300,
        compression=NoCompression(),
    )
    times = []
    try:
        for r in range(reps + 1):
            with averager.get_tensors() as tensors:
                tensors[0].copy_(values)
            dist.barrier()
            control = averager.step(wait=False, require_trigger=True, timeout=300)
            while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
                time.sleep(0.005)
            dist.barrier()  # everyone's group is formed: time the all-reduce alone
            t = time.perf_counter()
            control.allow_allreduce()
            control.result()
            wall = _barrier_time(time.perf_counter() - t)
            if r:
                times.append(wall)
        with averager.get_tensors() as tensors:
            err = _rel_error(tensors[0], exact)
    finally:
        averager.shutdown()
        dht.shutdown()
    return {"s": statistics.median(times), "bytes": 2 * (n - 1) * values.numel() * 4, "err": err}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(n: int, size_mb: int, reps: int, systems: tuple[str, ...]) -> dict:
    numel = size_mb * 1_000_000 // 4
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, n, numel, reps, port, systems, results)) for rank in range(n)]
    for p in procs:
        p.start()
    row = None
    while row is None:
        try:
            row = results.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"a peer process failed in the {n}-peer {size_mb} MB case (see its traceback)"
                ) from None
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    return row


def coding_throughput(size_mb: int = 100, reps: int = 21, device: str = "cpu") -> list[tuple[str, float]]:
    """int8 quantize + dequantize, and sparse encode + decode, of one buffer against copying it
    into a preallocated one, on `device` (on a GPU each timing waits for its kernels); and the
    sparse positions' byte coding, Elias-Fano against 12-bit fields (GB/s of the fp32 input)."""
    from dtnode.ops import sparse
    from dtnode.ops.positions import pack_positions, unpack_positions
    from dtnode.ops.quantization import QuantizedBlocks, dequantize, num_blocks, quantize, use_fused_kernels

    numel = size_mb * 1_000_000 // 4
    x = torch.randn(numel, device=device)
    dst = torch.empty_like(x)
    q = QuantizedBlocks(
        torch.empty(numel, dtype=torch.int8, device=device), torch.empty(num_blocks(numel, 256), device=device), 256
    )
    wait = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(reps):
            wait()
            t = time.perf_counter()
            fn()
            wait()
            samples.append(time.perf_counter() - t)
        return statistics.median(samples)

    def coding() -> None:
        quantize(x, 256, out=q)
        dequantize(q, out=dst)

    rows = [("memcpy dst.copy_(src)", timed(lambda: dst.copy_(x)))]
    use_fused_kernels(False)
    rows.append(("int8 quantize+dequantize, eager", timed(coding)))
    if use_fused_kernels(True):
        rows.append(("int8 quantize+dequantize, fused", timed(coding)))
    use_fused_kernels(False)
    residual = torch.zeros_like(x)
    rows.append(("sparse top-k encode+decode", timed(lambda: sparse.decode(sparse.encode(x), out=dst))))
    rows.append(
        (
            "sparse encode (error feedback)+decode",
            timed(lambda: sparse.decode(sparse.encode_with_feedback(x, residual), out=dst)),
        )
    )
    kept = sparse.encode(x)
    lengths = sparse.block_lengths(numel, kept.block_size, device)

    def fixed_width() -> None:  # the 12-bit positions the wire used before Elias-Fano, as a baseline
        packed = _pack_12_bit(kept.indices)
        _unpack_12_bit(packed, kept.kept)

    rows.append(("sparse positions, 12-bit pack+unpack", timed(fixed_width)))
    rows.append(
        (
            "sparse positions, Elias-Fano pack+unpack",
            timed(lambda: unpack_positions(pack_positions(kept.indices, kept.counts, lengths), kept.counts, lengths)),
        )
    )
    return [(name, 4 * numel / s / 1e9) for name, s in rows]


def _pack_12_bit(indices: torch.Tensor) -> torch.Tensor:
    idx = indices.to(torch.int32)
    if idx.numel() % 2:
        idx = torch.cat([idx, idx.new_zeros(1)])
    a, b = idx[0::2], idx[1::2]
    return torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1).to(torch.uint8).reshape(-1)


def _unpack_12_bit(packed: torch.Tensor, count: int) -> torch.Tensor:
    triples = packed.to(torch.int64).view(-1, 3)
    a = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    return torch.stack([a, b], dim=1).reshape(-1)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="2,4", help="comma-separated peer counts")
    parser.add_argument("--sizes-mb", default="10,100,400", help="comma-separated fp32 buffer sizes in MB")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per system (median reported)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    parser.add_argument("--coding-device", default="cpu", help="where the coding throughput table runs (cuda on a GPU)")
    parser.add_argument("--coding-only", action="store_true", help="only the coding throughput table")
    args = parser.parse_args()
    if args.coding_only:
        print_coding_throughput(args.coding_device)
        return
    systems = tuple(s for s in args.systems.split(",") if s)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, loopback; median of {args.reps} runs\n")
    header = f"{'peers':>5} {'MB':>5} {'system':<13} {'wall s':>8} {'MB sent':>9} {'x gloo':>7} {'rel err':>9}"
    print(header)
    print("-" * len(header))
    for n in (int(p) for p in args.peers.split(",")):
        for size in (int(s) for s in args.sizes_mb.split(",")):
            row = run_case(n, size, args.reps, systems)
            gloo = row.get("gloo", {}).get("s")
            for system in systems:
                r = row[system]
                ratio = f"{r['s'] / gloo:7.2f}" if gloo else "      -"
                print(
                    f"{n:>5} {size:>5} {system:<13} {r['s']:8.3f} {r['bytes'] / 1e6:9.1f} {ratio} {r['err']:9.2e}",
                    flush=True,
                )
            if "hivemind" in row and "ours-int8" in row:
                print(f"{'':>11} ours-int8 / hivemind: {row['ours-int8']['s'] / row['hivemind']['s']:.2f}", flush=True)
            for codec in ("int8", "fp32"):
                if f"ours-{codec}" in row and f"ours-{codec}-tls" in row:
                    cost = row[f"ours-{codec}-tls"]["s"] / row[f"ours-{codec}"]["s"] - 1
                    print(f"{'':>11} TLS costs ours-{codec} {cost:+.1%} of wall time", flush=True)
    print_coding_throughput(args.coding_device)


def print_coding_throughput(device: str) -> None:
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"
    print(f"\ncoding throughput on {device} ({name}), 100 MB fp32 buffer (GB/s of fp32 input)")
    rows = coding_throughput(device=device)
    memcpy = rows[0][1]
    for label, gbps in rows:
        print(f"  {label:<38} {gbps:7.2f} GB/s  {gbps / memcpy:6.1%} of memcpy")


if __name__ == "__main__":
    main()
