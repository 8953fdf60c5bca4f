"""Multi-rank host benchmark: a node with 1 local rank against a node with 2 (issue 32).

    .venv/bin/python -m tests.bench.host_ranks                      # small, CPU, gloo, 1 thread per rank
    .venv/bin/python -m tests.bench.host_ranks --model tiny --rounds 3
    .venv/bin/python -m tests.bench.host_ranks --compression sparse --configs 1,2s   # plain SGD, error feedback
    python3 -m tests.bench.host_ranks --device cuda --batch-size 16 --seq-len 512 --inner-steps 20   # NCCL

Each configuration is a real two-host swarm on loopback: the host under test (1 rank, 2 DDP
ranks, or 2 ranks with `--shard`; `--threads-per-rank 1`) and a 1-rank partner, `--pacing fixed` so that
every round has the same H inner steps on both hosts. The host's figures come from its own
/history (tokens/s per host, bytes on the wire per round, all-reduce seconds, the median
over its rounds after the first) and from sampling the resident memory of its processes
(peak RSS per rank, rank 0 being the node process with its DHT, gRPC and sidecar). The same
hosts again with `--baseline-model` (tiny) give the bytes of peak RSS per parameter: the
difference of the two peaks over the difference of the two models' sizes, which leaves out
what does not grow with the model (the interpreter, torch, the DHT). On a
2-core machine the 2-rank host's two ranks and the partner share the cores: tokens/s per
host measures the overhead of the rank protocol, not the speed-up GPUs would give.

`--device cuda` runs the same on the host's GPUs (one rank per GPU, NCCL between them, bf16): the
1-rank host, and with 2 or more GPUs the 2-rank hosts too. The partner shares GPU 0.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes import NodeProcess


def _flags(
    model: str, rounds: int, inner_steps: int, batch: int, seq_len: int, device: str, compression: str
) -> list[str]:
    return [
        "--model", model, "--device", device, "--threads-per-rank", "1", "--pacing", "fixed",
        "--inner-steps", str(inner_steps), "--batch-size", str(batch), "--seq-len", str(seq_len),
        "--max-rounds", str(rounds), "--no-fused-kernels", "--keep-checkpoints", "2",
        "--checkpoint-every", "100", "--matchmaking-window", "30", "--compression", compression,
    ]  # fmt: skip


def _sample_peaks(node: NodeProcess, peaks: dict[int, int], stop: threading.Event) -> None:
    """The peak RSS of the node process (rank 0) and of each child rank, by rank."""
    while not stop.is_set() and node.proc.poll() is None:
        try:
            parent = psutil.Process(node.proc.pid)
            ranks = [parent] + [c for c in parent.children() if "dtnode.daemon.training.ranks.child" in c.cmdline()]
            for rank, process in enumerate(ranks):
                peaks[rank] = max(peaks.get(rank, 0), process.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.2)


def parameter_count(model: str) -> int:
    from dtnode.daemon.workload.model import build_model

    built, _ = build_model(model, 0)
    return sum(p.numel() for p in built.parameters())


def run_config(tmp: Path, ranks: int, shard: bool, flags: list[str], tag: str = "") -> dict[str, float | list[int]]:
    name = f"{ranks}{'s' if shard else ''}{tag}"
    extra = ["--shard"] if shard else []
    host = NodeProcess.join(f"host{name}", tmp, *flags, *extra, "--nproc-per-node", str(ranks), "--min-peers", "2")
    partner = NodeProcess.join(f"partner{name}", tmp, *flags, "--nproc-per-node", "1", "--peer", host.join_address)
    peaks: dict[int, int] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_peaks, args=(host, peaks, stop), daemon=True)
    sampler.start()
    try:
        for node in (host, partner):
            code = node.wait(3600)
            if code != 0:
                raise SystemExit(f"{node.name} exited with {code}:\n{node.output[-3000:]}")
    finally:
        stop.set()
        host.kill()
        partner.kill()
    rounds = [r for r in host.rounds if r["outcome"] != "failed"][1:]  # the first carries start-up
    if not rounds:
        raise SystemExit(f"host{name} finished no rounds:\n{host.output[-3000:]}")
    full = sum(r["groups"] == [[2, 2]] for r in rounds)
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds),
        "bytes_per_round": statistics.median(r["bytes_sent"] + r["bytes_received"] for r in rounds),
        "allreduce_s": statistics.median(r["phases_s"].get("allreduce", 0.0) for r in rounds),
        "full": full / len(rounds),
        "peak_rss": [peaks[r] for r in sorted(peaks)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2, help="per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one rank per GPU, over NCCL")
    parser.add_argument(
        "--baseline-model", default="tiny", help="the smaller model of the bytes-per-parameter slope ('' to skip it)"
    )
    parser.add_argument("--compression", default="int8", choices=["int8", "sparse", "fp32"])
    parser.add_argument("--configs", default="1,2,2s", help="hosts to run: ranks, s for --shard (e.g. 1,2s)")
    args = parser.parse_args()
    shape = (args.inner_steps, args.batch_size, args.seq_len, args.device, args.compression)
    flags = _flags(args.model, args.rounds, *shape)
    small = None
    if args.baseline_model and args.baseline_model != args.model:
        small = _flags(args.baseline_model, 2, *shape)
    configs = [(int(c.rstrip("s")), c.endswith("s")) for c in args.configs.split(",")]
    if args.device == "cuda":
        import torch

        configs = configs if torch.cuda.device_count() >= 2 else configs[:1]  # NCCL: one rank per GPU
    tmp = Path(tempfile.mkdtemp(prefix="dtnode-bench-ranks-"))
    results, baseline = {}, {}
    try:
        for ranks, shard in configs:
            results[f"{ranks}-rank{' --shard' if shard else ''}"] = run_config(tmp, ranks, shard, flags)
            if small is not None:
                baseline[f"{ranks}-rank{' --shard' if shard else ''}"] = run_config(tmp, ranks, shard, small, "b")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"model {args.model}, {'CUDA, NCCL between ranks' if args.device == 'cuda' else 'CPU gloo, 1 thread per rank'}, "
        f"{args.compression}, batch {args.batch_size} per rank, seq {args.seq_len}, "
        f"H={args.inner_steps}, {args.rounds} rounds against a 1-rank partner (medians over rounds 2..)"
    )
    print(f"{'host':<16} {'tokens/s':>10} {'bytes/round':>13} {'allreduce s':>12} {'full':>6}  peak RSS per rank (MB)")
    for name, r in results.items():
        rss = ", ".join(f"{v / 1e6:.0f}" for v in r["peak_rss"])  # type: ignore[union-attr]
        print(
            f"{name:<16} {r['tokens_per_s']:>10.0f} {r['bytes_per_round']:>13.0f} {r['allreduce_s']:>12.3f} "
            f"{r['full']:>6.0%}  {rss}"
        )
    if baseline:
        extra = parameter_count(args.model) - parameter_count(args.baseline_model)
        print(
            f"peak RSS per parameter, per rank ({args.model} against {args.baseline_model}, {extra} parameters apart):"
        )
        for name, r in results.items():
            slopes = [
                (big - little) / extra
                for big, little in zip(r["peak_rss"], baseline[name]["peak_rss"], strict=True)  # type: ignore[arg-type]
            ]
            print(f"  {name:<16} " + ", ".join(f"{b:.1f} B" for b in slopes))
    if "1-rank" not in results:
        return
    one = float(results["1-rank"]["bytes_per_round"])  # type: ignore[arg-type]
    for name in [n for n in ("2-rank", "2-rank --shard") if n in results]:
        print(f"bytes per round, {name} / 1-rank: {float(results[name]['bytes_per_round']) / one:.4f}")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
