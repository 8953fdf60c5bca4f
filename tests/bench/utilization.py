"""Compute utilization on a slow link: the fraction of wall time in inner steps, with and without --overlap.

    .venv/bin/python -m tests.bench.utilization       # 4 peers of `small`, 100 Mbit/s and 50 ms each way
    .venv/bin/python -m tests.bench.utilization --inner-steps 100 --batch-size 8 --seq-len 1024 --device cuda

Each peer runs in its own network namespace, joined to the host by a veth pair limited to
--mbit in both directions (tc tbf); the host routes between the namespaces, so every byte of
every all-reduce crosses the sender's and the receiver's throttled links. Latency comes from a
relay (tests/latency_proxy.py; this host's tc has no netem): each peer announces an address on
the host side of its link where the relay holds every byte for --latency-ms before passing it
on, so every connection to a peer (DHT, gRPC, HTTP) sees a round trip of twice that. The model
is the `small` preset: 25.6M parameters, a 102 MB fp32 Δ (26 MB int8 on the wire). Every peer
takes exactly H steps a round (--pacing fixed), first without --overlap (the baseline: inner
steps wait for each average), then with it, in the same run.

Printed per mode and peer: the fraction of wall time from the first round's start to the last
round's end spent in inner steps (what each node logs when it stops), the all-reduce payload
sent per round, where the rest of a round went (the phases in each node's history), and with
--overlap how many inner steps into the next round each average's outer step landed.
Needs root and iproute2 (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chaos.netns import IsolatedHost, available
from nodes import NodeProcess, run_swarm

STOP_LINE = re.compile(r"stopped at outer step (\d+); (\d+\.\d)% of the time")
ROUND_LINE = re.compile(r"round (\d+) \|.*\((\d+(?:\.\d+)?) (B|kB|MB|GB) sent\)")
UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


PORTS = (7700, 7701, 7702)  # each node has its own namespace, so every node binds the same ports


def _route_through_host(hosts: list[IsolatedHost]) -> None:
    for host in hosts:
        subprocess.run(
            [*host.prefix, "ip", "route", "add", "default", "via", host.host_ip], check=True, capture_output=True
        )


def _relay_address(host: IsolatedHost) -> str:
    """The address a peer announces: on the host side of its link, where the latency relay listens."""
    return host.host_ip.rsplit(".", 1)[0] + ".3"


def _start_relay(hosts: list[IsolatedHost], delay_ms: float) -> subprocess.Popen:
    routes = []
    for host in hosts:
        relay = _relay_address(host)
        subprocess.run(["ip", "addr", "add", f"{relay}/32", "dev", host.outer_dev], check=True, capture_output=True)
        routes += [arg for port in PORTS for arg in ("--route", f"{relay}:{port}={host.inner_ip}:{port}")]
    relay = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve().parents[1] / "latency_proxy.py"),
            "--delay-ms",
            str(delay_ms),
            *routes,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    if relay.stdout.readline().strip() != "ready":
        raise RuntimeError("the latency relay did not start")
    return relay


def _history(state_dir: Path) -> list[dict]:
    path = state_dir / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _phases(history: list[dict]) -> dict[str, float]:
    """Seconds per phase over the node's recorded rounds."""
    totals: dict[str, float] = {}
    for entry in history:
        for phase, seconds in entry.get("phases_s", {}).items():
            totals[phase] = totals.get(phase, 0.0) + seconds
    return totals


def run_mode(overlap: bool, args: argparse.Namespace, hosts: list[IsolatedHost], tmp: Path) -> list[dict]:
    flags = [
        "--model",
        args.model,
        "--device",
        args.device,
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--inner-steps",
        str(args.inner_steps),
        "--pacing",
        "fixed",
        "--max-rounds",
        str(args.rounds),
        "--min-peers",
        str(len(hosts)),
        "--bandwidth-mbps",
        str(args.mbit),
        "--allreduce-timeout",
        "600",
        "--matchmaking-window",
        "60",
        "--join-timeout",
        "300",
        "--checkpoint-every",
        "1000000",
        "--no-fused-kernels",
        "--eval-sequences",
        str(args.eval_sequences),
        "--eval-every",
        str(args.eval_every),
        "--run-id",
        f"util-{int(overlap)}",
    ]
    if overlap:
        flags.append("--overlap")
    base = tmp / ("overlap" if overlap else "baseline")

    def node(i: int, *extra: str) -> NodeProcess:
        host = hosts[i]
        ports = [
            flag
            for name, port in zip(("--dht-port", "--grpc-port", "--http-port"), PORTS)
            for flag in (name, str(port))
        ]
        announce = ["--announce-host", _relay_address(host)] if args.latency_ms else []
        return NodeProcess.join(
            f"p{i}", base, *flags, *ports, *announce, *extra, host=host.inner_ip, prefix=host.prefix
        )

    nodes = run_swarm(node(0), lambda address: [node(i, "--peer", address) for i in range(1, len(hosts))])
    rows = []
    for node in nodes:
        if "Traceback" in node.output:
            print(f"  warning: a traceback in {node.name}'s log", file=sys.stderr)
        stop = STOP_LINE.search(node.output)
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            (args.keep_logs / f"{base.name}-{node.name}.log").write_text(node.output)
        rounds = ROUND_LINE.findall(node.output)
        sent = sum(float(v) * UNITS[u] for _, v, u in rounds)
        history = _history(node.state_dir)
        rows.append(
            {
                "peer": node.name,
                "utilization": float(stop.group(2)) / 100 if stop else float("nan"),
                "sent": sent,
                "rounds": len(rounds),
                "phases": _phases(history),
                "landed": [e["landed_after_steps"] for e in history if e.get("landed_after_steps") is not None],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--latency-ms", type=float, default=50.0, help="one-way delay to every peer (0: none)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--inner-steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--eval-sequences", type=int, default=64)
    parser.add_argument(
        "--eval-every",
        type=int,
        default=4,
        help="the nodes' --eval-every: an eval is a forward "
        "pass over --eval-sequences windows, as many tokens as a CPU-sized round trains",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--keep-logs", type=Path, help="write each node's log into this directory")
    args = parser.parse_args()
    if (why := available()) is not None:
        raise SystemExit(f"needs network namespaces: {why}")
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    was_forwarding = forward.read_text().strip()
    forward.write_text("1")
    hosts: list[IsolatedHost] = []
    relay = None
    try:
        hosts = [IsolatedHost() for _ in range(args.peers)]
        _route_through_host(hosts)
        for host in hosts:
            host.throttle(args.mbit)
        relay = _start_relay(hosts, args.latency_ms) if args.latency_ms else None
        with tempfile.TemporaryDirectory() as tmp:
            results = {}
            for overlap in (False, True):
                started = time.monotonic()
                results[overlap] = run_mode(overlap, args, hosts, Path(tmp))
                print(f"  {'--overlap' if overlap else 'baseline '}: {time.monotonic() - started:.0f}s", flush=True)
    finally:
        if relay is not None:
            relay.kill()
        for host in hosts:
            host.close()
        forward.write_text(was_forwarding)
    print(
        f"\n{args.peers} peers of {args.model}, {args.mbit:g} Mbit/s per peer (tc tbf), {args.latency_ms:g} ms each "
        f"way, H={args.inner_steps}, {args.rounds} rounds, batch {args.batch_size} x {args.seq_len}, "
        f"eval {args.eval_sequences} sequences every {args.eval_every} rounds, {args.device}"
    )
    print(f"  {'peer':<6} {'in inner steps':>15} {'with --overlap':>15} {'sent per round':>15}")
    for base, over in zip(results[False], results[True]):
        per_round = base["sent"] / max(base["rounds"], 1) / 1e6
        print(f"  {base['peer']:<6} {base['utilization']:>15.1%} {over['utilization']:>15.1%} {per_round:>12.1f} MB")
    mean = {k: sum(r["utilization"] for r in v) / len(v) for k, v in results.items()}
    print(f"  {'mean':<6} {mean[False]:>15.1%} {mean[True]:>15.1%}")
    for overlap, rows in results.items():
        totals: dict[str, float] = {}
        for row in rows:
            for phase, seconds in row["phases"].items():
                totals[phase] = totals.get(phase, 0.0) + seconds / len(rows)
        spent = "  ".join(f"{phase} {seconds:.1f}s" for phase, seconds in totals.items())
        print(f"  {'--overlap' if overlap else 'baseline'}: per peer, over its rounds: {spent}")
    landed = [steps for row in results[True] for steps in row["landed"]]
    if landed:  # how stale the outer step was: the fewer steps, the closer to DiLoCo without overlap
        print(
            f"  --overlap: each average's outer step landed after {sum(landed) / len(landed):.1f} of the next "
            f"round's {args.inner_steps} inner steps on average (max {max(landed)})"
        )


if __name__ == "__main__":
    main()
