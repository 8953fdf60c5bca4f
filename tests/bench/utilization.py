"""Compute utilization on a slow link: the fraction of wall time in inner steps, with and without --overlap.

    .venv/bin/python -m tests.bench.utilization                       # 4 peers of `small`, 100 Mbit/s each
    .venv/bin/python -m tests.bench.utilization --inner-steps 16 --rounds 6 --device cuda   # a GPU box

Each peer runs in its own network namespace, joined to the host by a veth pair limited to
--mbit in both directions (tc tbf); the host routes between the namespaces, so every byte of
every all-reduce crosses the sender's and the receiver's throttled links. The model is the
`small` preset: 25.6M parameters, a 102 MB fp32 Δ (26 MB int8 on the wire). Every peer takes
exactly H steps a round (--pacing fixed), first without --overlap (the baseline: inner steps
wait for each average), then with it, in the same run.

Printed per mode and peer: the fraction of wall time from the first round's start to the last
round's end spent in inner steps (what each node logs when it stops) and the all-reduce payload sent per round. No latency is added: this host's tc has no netem (see README).
Needs root and iproute2 (network namespaces).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chaos.netns import IsolatedHost, available  # noqa: E402
from nodes import NodeProcess, run_swarm  # noqa: E402

STOP_LINE = re.compile(r"stopped at outer step (\d+); (\d+\.\d)% of the time")
ROUND_LINE = re.compile(r"round (\d+) \|.*\((\d+(?:\.\d+)?) (B|kB|MB|GB) sent\)")
UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


def _route_through_host(hosts: list[IsolatedHost]) -> None:
    for host in hosts:
        subprocess.run([*host.prefix, "ip", "route", "add", "default", "via", host.host_ip], check=True,
                       capture_output=True)


def run_mode(overlap: bool, args: argparse.Namespace, hosts: list[IsolatedHost], tmp: Path) -> list[dict]:
    flags = ["--model", args.model, "--device", args.device, "--batch-size", str(args.batch_size), "--seq-len",
             str(args.seq_len), "--inner-steps", str(args.inner_steps), "--pacing", "fixed", "--max-rounds",
             str(args.rounds), "--min-peers", str(len(hosts)), "--bandwidth-mbps", str(args.mbit),
             "--allreduce-timeout", "600", "--matchmaking-window", "60", "--join-timeout", "300",
             "--checkpoint-every", "1000000", "--no-fused-kernels", "--run-id", f"util-{int(overlap)}"]
    if overlap:
        flags.append("--overlap")
    base = tmp / ("overlap" if overlap else "baseline")
    nodes = run_swarm(NodeProcess.join("p0", base, *flags, host=hosts[0].inner_ip, prefix=hosts[0].prefix),
                      lambda address: [NodeProcess.join(f"p{i}", base, *flags, "--peer", address, host=h.inner_ip,
                                                        prefix=h.prefix) for i, h in enumerate(hosts[1:], start=1)])
    rows = []
    for node in nodes:
        if "Traceback" in node.output:
            print(f"  warning: a traceback in {node.name}'s log", file=sys.stderr)
        stop = STOP_LINE.search(node.output)
        rounds = ROUND_LINE.findall(node.output)
        sent = sum(float(v) * UNITS[u] for _, v, u in rounds)
        rows.append({"peer": node.name, "utilization": float(stop.group(2)) / 100 if stop else float("nan"),
                     "sent": sent, "rounds": len(rounds)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if (why := available()) is not None:
        raise SystemExit(f"needs network namespaces: {why}")
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    was_forwarding = forward.read_text().strip()
    forward.write_text("1")
    hosts: list[IsolatedHost] = []
    try:
        hosts = [IsolatedHost() for _ in range(args.peers)]
        _route_through_host(hosts)
        for host in hosts:
            host.throttle(args.mbit)
        with tempfile.TemporaryDirectory() as tmp:
            results = {}
            for overlap in (False, True):
                started = time.monotonic()
                results[overlap] = run_mode(overlap, args, hosts, Path(tmp))
                print(f"  {'--overlap' if overlap else 'baseline '}: {time.monotonic() - started:.0f}s", flush=True)
    finally:
        for host in hosts:
            host.close()
        forward.write_text(was_forwarding)
    print(f"\n{args.peers} peers of {args.model}, {args.mbit:g} Mbit/s per peer (tc tbf), H={args.inner_steps}, "
          f"{args.rounds} rounds, batch {args.batch_size} x {args.seq_len}, {args.device}")
    print(f"  {'peer':<6} {'in inner steps':>15} {'with --overlap':>15} {'sent per round':>15}")
    for base, over in zip(results[False], results[True]):
        per_round = base["sent"] / max(base["rounds"], 1) / 1e6
        print(f"  {base['peer']:<6} {base['utilization']:>15.1%} {over['utilization']:>15.1%} {per_round:>12.1f} MB")
    mean = {k: sum(r["utilization"] for r in v) / len(v) for k, v in results.items()}
    print(f"  {'mean':<6} {mean[False]:>15.1%} {mean[True]:>15.1%}")


if __name__ == "__main__":
    main()
