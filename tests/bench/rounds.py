"""Round health: do rounds hold in the swarms users run (uneven peers, real sizes, several groups)?

    .venv/bin/python -m tests.bench.rounds                       # every scenario, 12 rounds each
    .venv/bin/python -m tests.bench.rounds --scenarios b,c --rounds 8
    .venv/bin/python -m tests.bench.rounds --pacing fixed        # the baseline: every peer exactly H steps

Scenarios (real node processes on loopback):
  a-slow   4 peers of the `small` preset, one 4x slower (DTNODE_TEST_SLOW_INNER=4)
  a-batch  4 peers of the `small` preset, one with 4x the batch
  b        9 tiny peers, target group 3, started 2 s apart
  c        12 tiny peers, target group 4
  d        4 tiny peers, one paused (SIGSTOP) for 3 s during its inner steps in every round
  e        5 tiny peers, target group 2 (three hops, cells of 0 to 3), started 2 s apart
  f        4 tiny peers, H=50 (the pacing check: tokens trained over tokens asked)
  g        4 tiny peers, H=10 at the default 2 s heartbeat: rounds shorter than a heartbeat

Printed per scenario, over the rounds from --from-round on:
  full      fraction of rounds in which every peer took part and every group it joined held
            every member it expected (no hop cut short, no failed part)
  agree     fraction of rounds after which every peer's θ_g is within --tolerance of the
            swarm's mean θ_g (relative L2; bitwise equality is only possible within a group);
            for the a scenarios (one group, no per-round checkpoints) equal θ_g hashes
  same-hash fraction of rounds after which all θ_g hashes are equal
  downloads catch-up downloads; given-up inner steps (abandoned rounds); tokens per peer;
  spread    final relative spread of θ_g; the unhandled exceptions in every node's log;
  tokens/asked  the swarm's tokens over H x the peers' tokens per step (a step above the
            median counted as far as the peer's measured rate backs it, as pacing does), in the
            counted rounds every peer trained (swarm pacing aims at 1.0);
  slow x k  the slow peer's tokens over a fast peer's, times k (its slowness): 1.0 is its share;
  by speed  the same with k measured: the fast peers' mean tok/s over the slow one's.
Tiny nodes write a checkpoint every round (--checkpoint-every 1) so θ_g can be compared; every
node writes one when it stops, for the final spread. `--device cuda` runs the a scenarios on a GPU.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes import NodeProcess, theta

from dtnode.peers.pacing import counted_steps

RATE_LINE = re.compile(r"round (\d+) \|.* \| (\d+) tok/s \|")
ROUND_LINE = re.compile(r"round (\d+) \| groups ((?:\d+/\d+(?:\+\d+)? ?)+) \| (\d+) steps (\d+) tok .*params (\w+)")
COMMON = [
    "--matchmaking-window",
    "15",
    "--join-timeout",
    "240",
    "--peer-ttl",
    "6",
    "--heartbeat-interval",
    "1",
    "--no-fused-kernels",
    "--keep-checkpoints",
    "100",
]
TINY = ["--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--inner-steps", "20"]
SMALL = ["--model", "small", "--batch-size", "2", "--seq-len", "64", "--inner-steps", "4", "--allreduce-timeout", "120"]


@dataclass
class Peer:
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Scenario:
    name: str
    title: str
    peers: list[Peer]
    group: int
    stagger: float = 0.0
    pause_victim: int | None = None
    # tiny models write a checkpoint every round, so θ_g can be compared round by round; a
    # `small` swarm is one group, whose members' θ_g are bitwise equal: hashes tell agreement
    checkpoint_every_round: bool = True


def scenarios() -> dict[str, Scenario]:
    return {
        "a-slow": Scenario(
            "a-slow",
            "4 small, one 4x slower",
            [Peer(SMALL) for _ in range(3)] + [Peer(SMALL, {"DTNODE_TEST_SLOW_INNER": "4"})],
            group=4,
            checkpoint_every_round=False,
        ),
        "a-batch": Scenario(
            "a-batch",
            "4 small, one 4x batch",
            [Peer(SMALL) for _ in range(3)] + [Peer([*SMALL, "--batch-size", "8"])],
            group=4,
            checkpoint_every_round=False,
        ),
        "b": Scenario("b", "9 tiny, group 3, 2 s apart", [Peer(TINY) for _ in range(9)], group=3, stagger=2.0),
        "c": Scenario("c", "12 tiny, group 4", [Peer(TINY) for _ in range(12)], group=4),
        "d": Scenario(
            "d",
            "4 tiny, one paused 3 s a round",
            [Peer([*TINY, "--batch-size", "32"]) for _ in range(4)],
            group=4,
            pause_victim=3,
        ),
        "e": Scenario("e", "5 tiny, group 2, 2 s apart", [Peer(TINY) for _ in range(5)], group=2, stagger=2.0),
        "f": Scenario("f", "4 tiny, H=50", [Peer([*TINY, "--inner-steps", "50"]) for _ in range(4)], group=4),
        "g": Scenario(
            "g",
            "4 tiny, H=10, heartbeat 2 s (rounds shorter than a heartbeat)",
            [Peer([*TINY, "--inner-steps", "10", "--heartbeat-interval", "2"]) for _ in range(4)],
            group=4,
        ),
    }


def _flag(args: list[str], name: str) -> int:
    """The value of the last `name` in a node's arguments (later flags win, as in argparse)."""
    return int(args[len(args) - 1 - args[::-1].index(name) + 1])


@dataclass(frozen=True)
class _Pace:
    """A peer's step and measured rate, as `counted_steps` reads a record."""

    tokens_per_step: int
    tokens_per_s: float


def pacing_figures(
    scenario: Scenario,
    per_node_args: list[list[str]],
    round_tokens: dict[int, dict[str, int]],
    counted: list[int],
    rates: dict[str, float],
) -> tuple[float, float | None, float | None]:
    """(overshoot, slow share, slow share by speed): the swarm's tokens over the tokens asked (H
    x the live peers' tokens per step, summed over the counted rounds every peer trained), and
    for a scenario with a slower peer, its tokens over a fast peer's mean times k (1.0: exactly
    its share), with k its nominal slowness, then with k the ratio of the measured rates (on a
    shared host the slow peer's compute is slowed by the others too)."""
    names = [f"n{i}" for i in range(len(scenario.peers))]
    per_step = {n: _flag(a, "--batch-size") * _flag(a, "--seq-len") for n, a in zip(names, per_node_args)}
    h = {n: _flag(a, "--inner-steps") for n, a in zip(names, per_node_args)}
    whole = [r for r in counted if len(round_tokens.get(r, {})) == len(names)]
    if not whole:
        return float("nan"), None, None
    done = sum(sum(round_tokens[r].values()) for r in whole)
    # what pacing asks (peers/pacing.py counted_steps): a step above the median counts as far as
    # its peer's measured rate backs it
    steps = counted_steps([_Pace(per_step[n], rates.get(n, 0.0)) for n in names])
    asked = len(whole) * max(h.values()) * sum(steps)
    slow = [(n, float(p.env["DTNODE_TEST_SLOW_INNER"])) for n, p in zip(names, scenario.peers) if p.env]
    if not slow:
        return done / asked, None, None
    name, k = slow[0]
    fast = [n for n in names if n != name]
    slow_tokens = sum(round_tokens[r][name] for r in whole)
    fast_tokens = sum(round_tokens[r][n] for r in whole for n in fast) / len(fast)
    measured_k = sum(rates[n] for n in fast) / len(fast) / max(rates[name], 1e-9)
    return done / asked, (slow_tokens / fast_tokens) * k, (slow_tokens / fast_tokens) * measured_k


def pause_every_round(node: NodeProcess, stop: threading.Event, seconds: float = 3.0) -> list[int]:
    """SIGSTOP the node for `seconds` once per outer step, while it is in its inner steps."""
    paused = []
    while not stop.is_set() and node.proc.poll() is None:
        try:
            status = node.get("/status")
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        step = status["outer_step"]
        if status["phase"] == "inner" and status["state"] == "training" and step not in paused:
            node.stop(signal.SIGSTOP)
            stop.wait(seconds)
            node.stop(signal.SIGCONT)
            paused.append(step)
        time.sleep(0.05)
    return paused


def relative_spread(thetas: list[torch.Tensor]) -> float:
    stacked = torch.stack(thetas)
    mean = stacked.mean(0)
    return float((stacked - mean).norm(dim=1).max() / mean.norm())


def run(
    scenario: Scenario, rounds: int, pacing: str, tmp: Path, from_round: int, tolerance: float, node_args: list[str]
) -> dict:
    extra = [
        *COMMON,
        *node_args,
        "--pacing",
        pacing,
        "--target-group-size",
        str(scenario.group),
        "--max-rounds",
        str(rounds),
        "--min-peers",
        str(len(scenario.peers)),
        "--checkpoint-every",
        "1" if scenario.checkpoint_every_round else str(10 * rounds),
    ]
    nodes: list[NodeProcess] = []
    stop = threading.Event()
    pauser = None
    try:
        for i, peer in enumerate(scenario.peers):
            join = ["--peer", nodes[0].join_address] if nodes else []
            nodes.append(NodeProcess.join(f"n{i}", tmp, *extra, *peer.args, *join, env=peer.env))
            if scenario.stagger and i + 1 < len(scenario.peers):
                time.sleep(scenario.stagger)
        if scenario.pause_victim is not None:
            pauser = threading.Thread(target=pause_every_round, args=(nodes[scenario.pause_victim], stop), daemon=True)
            pauser.start()
        codes = [node.wait(1800) for node in nodes]
    finally:
        stop.set()
        if pauser is not None:
            pauser.join(5)
        for node in nodes:
            node.stop(signal.SIGCONT)
            node.kill()
    logs = {node.name: node.output for node in nodes}
    per_round: dict[int, dict[str, tuple[bool, str]]] = {}
    round_tokens: dict[int, dict[str, int]] = {}
    tokens = {}
    for node in nodes:
        tokens[node.name] = 0
        for m in ROUND_LINE.finditer(logs[node.name]):
            hops = m.group(2).split()
            full = all(int(h.split("/")[0]) == int(h.split("/")[1].split("+")[0]) for h in hops)
            per_round.setdefault(int(m.group(1)), {})[node.name] = (full, m.group(5))
            round_tokens.setdefault(int(m.group(1)), {})[node.name] = int(m.group(4))
            tokens[node.name] += int(m.group(4))
    counted = [r for r in range(from_round, rounds)]
    rates = {}
    for node in nodes:
        found = [
            float(m.group(2)) for m in RATE_LINE.finditer(logs[node.name]) if from_round <= int(m.group(1)) < rounds
        ]
        rates[node.name] = sum(found) / len(found) if found else float("nan")
    overshoot, slow_share, slow_by_speed = pacing_figures(
        scenario, [[*extra, *p.args] for p in scenario.peers], round_tokens, counted, rates
    )
    full = agree = same = 0
    for r in counted:
        seen = per_round.get(r, {})
        if len(seen) == len(nodes) and all(f for f, _ in seen.values()):
            full += 1
        hashes_agree = len(seen) == len(nodes) and len({h for _, h in seen.values()}) == 1
        same += hashes_agree
        if not scenario.checkpoint_every_round:
            agree += hashes_agree
            continue
        try:
            if relative_spread([theta(n.state_dir, r + 1) for n in nodes]) <= tolerance:
                agree += 1
        except FileNotFoundError:  # a node skipped this step (it downloaded past it)
            pass
    final_step = min(
        max((int(r) for r in re.findall(r"stopped at outer step (\d+)", logs[n.name])), default=0) for n in nodes
    )
    try:
        spread = relative_spread([theta(n.state_dir, final_step) for n in nodes])
    except FileNotFoundError:
        spread = float("nan")
    text = "\n".join(logs.values())
    return {
        "scenario": scenario.name,
        "title": scenario.title,
        "rounds": len(counted),
        "full": full / len(counted),
        "agree": agree / len(counted),
        "same_hash": same / len(counted),
        "downloads": text.count("in sync at outer step"),
        "given_up": sum(int(k) for k in re.findall(r"abandoned after (\d+) inner steps", text)),
        "tokens": [tokens[n.name] for n in nodes],
        "overshoot": overshoot,
        "slow_share": slow_share,
        "slow_by_speed": slow_by_speed,
        "spread": spread,
        "exceptions": text.count("Traceback") + text.count("Unhandled exception"),
        "round_failures": text.count("failed ("),
        "exit_codes": codes,
        "final_step": final_step,
        "logs": logs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="a-slow,a-batch,b,c,d,e")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--from-round", type=int, default=3, help="first round counted (earlier ones warm up)")
    parser.add_argument("--pacing", default="swarm", choices=["swarm", "fixed"])
    parser.add_argument("--tolerance", type=float, default=1e-3, help="relative θ_g spread that counts as agreement")
    parser.add_argument("--keep", help="copy every node's log here")
    parser.add_argument("--device", default="cpu", help="--device of every node (the a scenarios on a GPU host: cuda)")
    parser.add_argument("--debug", action="store_true", help="nodes log at DEBUG (every hop's groups; use with --keep)")
    args = parser.parse_args()
    table = scenarios()
    results = []
    for name in args.scenarios.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            started = time.monotonic()
            node_args = ["--device", args.device] if name.startswith("a") else []
            node_args += ["--log-level", "DEBUG"] if args.debug else []
            result = run(table[name], args.rounds, args.pacing, Path(tmp), args.from_round, args.tolerance, node_args)
            result["seconds"] = time.monotonic() - started
            if args.keep:
                dest = Path(args.keep) / f"{name}-{args.pacing}"
                dest.mkdir(parents=True, exist_ok=True)
                for node_name, text in result.pop("logs").items():
                    (dest / f"{node_name}.log").write_text(text)
            results.append(result)
            print(f"{name}: done in {result['seconds']:.0f}s, exit codes {result['exit_codes']}", flush=True)
    print(
        f"\npacing {args.pacing}; rounds {args.from_round}..{args.rounds - 1} counted; "
        f"agreement: relative θ_g spread <= {args.tolerance:g}"
    )
    print(
        f"{'scenario':<34} {'rounds':>6} {'full':>6} {'agree':>6} {'same-hash':>9} {'downloads':>9} "
        f"{'given-up':>8} {'spread':>9} {'exc':>4} {'tokens/asked':>12} {'slow x k':>8} {'by speed':>8}  tokens per peer"
    )
    for r in results:
        print(
            f"{r['scenario'] + ' ' + r['title']:<34} {r['rounds']:>6} {r['full']:>6.0%} {r['agree']:>6.0%} "
            f"{r['same_hash']:>9.0%} {r['downloads']:>9} {r['given_up']:>8} {r['spread']:>9.1e} "
            f"{r['exceptions']:>4} {r['overshoot']:>12.3f} "
            f"{'-' if r['slow_share'] is None else format(r['slow_share'], '.2f'):>8} "
            f"{'-' if r['slow_by_speed'] is None else format(r['slow_by_speed'], '.2f'):>8}  "
            f"{' '.join(str(t) for t in r['tokens'])}"
        )


if __name__ == "__main__":
    main()
