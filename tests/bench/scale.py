"""Scale: n real node processes on one box, and how each cost grows with n (issue 60).

    .venv/bin/python -m tests.bench.scale                          # n = 8, 16, 24, 32, 10 rounds each
    .venv/bin/python -m tests.bench.scale --sizes 8,16 --rounds 6 --keep /tmp/scale-keep
    .venv/bin/python -m tests.bench.scale --sizes 32 --rounds 6 --churn 4   # 4 killed, 4 joining mid-round
    .venv/bin/python -m tests.bench.scale --sizes 32 --per-round   # and a line per round: who missed, why

Every run starts n `tiny` nodes (one --peer, the first node's address), --min-peers n, the
default moshpit grid for n (`--target-group-size` 4), and rounds paced by time: each round's
inner steps end after --round-seconds whatever the tokens (the tokens asked for are out of
reach), and every inner step takes at least --step-floor seconds (it sleeps the rest), so that
the training of n nodes does not take the cores their swarm's costs are measured on: what is
left is what a node costs besides its training. Per n it prints:

- `full`: the share of rounds in which every node's average ended `full` (every group whole,
  no part failed: history.jsonl's `outcome`); a node with no entry for a round (it fell behind
  and caught up past it) makes that round not full;
- `agree`: the share of rounds after which every node holds one θ_g (one `params_sha256`; a node
  that skipped the round holds none of it), and the most distinct θ_g seen after a round;
- `mm p50/p95`: matchmaking seconds per hop (a round's matchmaking phase over its hops), and
  `net p95` the same without the seconds until the hop's last registrant was read
  (`matchmaking_waited_s`): what forming costs once everyone is there, apart from waiting for a
  member still in its previous hop or step;
- `dht req`: the DHT reads and writes a node makes per round (`dtnode_dht_requests_total`), and
  `mem get` the reads of the membership among them (each brings every peer's record back),
  and `unans` its requests to other DHT peers that went unanswered (`dtnode_dht_unanswered_total`:
  a peer paused, gone or slower than hivemind's wait, peers/dht_unanswered.py);
- `dht kB`: bytes the node's p2pd daemon passed through read and write calls per round
  (/proc/PID/io: the network, and the socket to the DHT node, which ran in a process of its own
  forked from the node until issue 60 moved it onto the node's loop; counting p2pd alone reads
  the same traffic either way);
  both counted from the moment the last node starts (a node's own start is no round's cost);
- `resync`: θ_g re-syncs per node per round (`dtnode_theta_resyncs_total`);
- `rss` and `pss`: the median node's peak resident and proportional memory (the node's process
  tree: the node and p2pd, and before issue 60's change its forked DHT process; PSS counts a page shared by k processes as 1/k of it in each), and
  the swarm's PSS summed at its peak;
- `idle pss` and `idle cores`: n - 1 nodes started and waiting for the last one (--min-peers n),
  for --idle-seconds: their summed PSS (scaled by n / (n - 1)) and CPU use, the cost of a swarm
  that has nothing to do (polls, heartbeats, record checks, p2pd);
- `tracebacks`: nodes whose log holds one.

With --churn K, K nodes (never the first) are killed (SIGKILL) halfway through round
--churn-round's inner steps and K new ones join at once; a second table says, for the rounds
after it, the share of survivors whose average ended `full`, and for each joiner the round it
first averaged, that round's outcome and the seconds from its start to the end of that round;
the row's figures are then the survivors' (the nodes that ran every round).

The counters are read from each node's /metrics and /proc every few seconds while it runs (a
node that exited keeps its last reading). Runs under no test marker: it is a benchmark.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import astuple, dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes import NodeProcess, step_floor, time_paced_swarm, wait_until

SAMPLE_S = 10.0  # between readings of every node's counters and memory
GROUP_SIZE = 4


def smaps_rollup(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in bytes from /proc/PID/smaps_rollup: the kernel's sums, far cheaper to read
    than the per-mapping smaps that psutil's memory_full_info parses (a torch process has
    thousands of mappings, and 96 processes are read every few seconds)."""
    rss = pss = 0.0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for row in f:
            if row.startswith("Rss:"):
                rss = float(row.split()[1]) * 1024
            elif row.startswith("Pss:"):
                pss = float(row.split()[1]) * 1024
    return rss, pss


def is_up(node: NodeProcess) -> bool:
    """Whether the node has said where its status endpoint is (without waiting for it: a box
    starting 32 nodes takes minutes to bring the last one up)."""
    return any("/status, gRPC" in line for line in node.lines)


def metric_samples(node: NodeProcess) -> dict[tuple[str, tuple], float]:
    """Every sample of the node's /metrics, by (name, sorted labels); empty while it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    if not is_up(node):
        return {}
    try:
        text = node.get_text("/metrics")
    except (OSError, ValueError):
        return {}
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@dataclass
class Reading:
    """The last counters read from one node (its process tree and its /metrics)."""

    rss: float = 0.0  # bytes, the node's process tree (the node and p2pd)
    pss: float = 0.0
    dht_io: float = 0.0  # read + write chars of p2pd
    dht_requests: float = 0.0
    membership_gets: float = 0.0
    dht_unanswered: float = 0.0
    resyncs: float = 0.0
    cpu_s: float = 0.0  # user + system seconds of the tree


@dataclass
class Sampler:
    """Reads every node's counters every SAMPLE_S on a thread of its own; keeps each node's last
    reading, the swarm's peak summed PSS and its CPU seconds over time."""

    nodes: list[NodeProcess]
    last: dict[str, Reading] = field(default_factory=dict)
    peak_pss: float = 0.0
    cpu_track: list[tuple[float, float]] = field(default_factory=list)  # (monotonic, summed cpu seconds)
    current_pss: dict[str, float] = field(default_factory=dict)  # each node's PSS at the last reading
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        """One reading of every node, now: the thread's every SAMPLE_S, and the idle window's two
        ends (its mean cores need a reading at each: a window shorter than two periods held one or
        none, and `idle cores` read nan)."""
        with self._lock:
            total_pss = total_cpu = 0.0
            for node in self.nodes:
                reading = self.read(node)
                if reading is not None:
                    self.current_pss[node.name] = reading.pss
                if reading is None:
                    reading = self.last.get(node.name, Reading())
                else:  # counters only grow, and memory is kept at its peak: a node shutting down reads low
                    reading = self.last[node.name] = Reading(
                        *(max(a, b) for a, b in zip(astuple(reading), astuple(self.last.get(node.name, Reading()))))
                    )
                total_pss += self.current_pss.get(node.name, 0.0) if node.proc.poll() is None else 0.0
                total_cpu += reading.cpu_s
            self.peak_pss = max(self.peak_pss, total_pss)
            self.cpu_track.append((time.monotonic(), total_cpu))

    @staticmethod
    def read(node: NodeProcess) -> Reading | None:
        if node.proc.poll() is not None:
            return None
        try:
            root = psutil.Process(node.proc.pid)
            out = Reading()
            for proc in [root, *root.children(recursive=True)]:
                rss, pss = smaps_rollup(proc.pid)
                times = proc.cpu_times()
                out.rss, out.pss, out.cpu_s = out.rss + rss, out.pss + pss, out.cpu_s + times.user + times.system
                if proc.name() == "p2pd":
                    io = proc.io_counters()
                    out.dht_io += io.read_chars + io.write_chars
        except (psutil.Error, OSError):
            return None
        samples = metric_samples(node)
        out.dht_requests = sum(v for (name, _), v in samples.items() if name == "dtnode_dht_requests_total")
        out.membership_gets = sum(
            v
            for (name, labels), v in samples.items()
            if name == "dtnode_dht_requests_total"
            and dict(labels).get("key") == "membership"
            and ("op", "get") in labels
        )
        out.dht_unanswered = sum(v for (name, _), v in samples.items() if name == "dtnode_dht_unanswered_total")
        out.resyncs = sum(v for (name, _), v in samples.items() if name == "dtnode_theta_resyncs_total")
        return out

    def cores_between(self, start: float, end: float) -> float:
        """The swarm's mean CPU use (cores) between two monotonic times, from the readings."""
        inside = [(t, c) for t, c in self.cpu_track if start <= t <= end]
        if len(inside) < 2:
            return float("nan")
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        return (c1 - c0) / max(t1 - t0, 1e-9)


@dataclass
class Row:
    n: int
    rounds: int
    full: float
    agree: float
    most_hashes: int
    mm_p50: float
    mm_p95: float
    net_p95: float  # mm_p95 without the wait for each hop's last registrant
    dht_requests: float
    membership_gets: float
    dht_unanswered: float
    dht_kb: float
    resyncs: float
    rss_mb: float
    pss_mb: float
    peak_pss_gb: float
    idle_pss_gb: float  # the waiting n - 1 nodes' summed PSS, scaled to n
    idle_cores: float  # the waiting n - 1 nodes' CPU use
    tracebacks: int
    wall_s: float


def node_args(n: int, args: argparse.Namespace) -> list[str]:
    timeouts = ["--allreduce-timeout-min", f"{args.allreduce_timeout_min:g}"] if args.allreduce_timeout_min else []
    return [*time_paced_swarm(n, args.rounds, args.round_seconds, GROUP_SIZE, join_timeout=900), *timeouts]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


@dataclass
class Churn:
    """K nodes killed halfway through a round's inner steps, and K new ones joined at once."""

    round_no: int
    killed: list[NodeProcess]
    survivors: list[NodeProcess]
    joiners: list[NodeProcess]
    started: dict[str, float]  # joiner -> wall time it was started

    @classmethod
    def during(
        cls, nodes: list[NodeProcess], args: argparse.Namespace, base: Path, address: str, env: dict, deadline: float
    ) -> Churn:
        round_no = args.churn_round if args.churn_round >= 0 else args.rounds // 2
        # round `round_no` is under way once the first node has a history entry of the round before
        wait_until(
            lambda: any(e["round"] >= round_no - 1 for e in nodes[0].rounds),
            max(deadline - time.monotonic(), 1),
            f"round {round_no}",
        )
        time.sleep(args.round_seconds / 2)
        killed = random.Random(round_no).sample(nodes[1:], args.churn)
        for node in killed:
            node.kill()
        survivors = [node for node in nodes if node not in killed]
        started, joiners = {}, []
        for i in range(args.churn):
            name = f"j{i:02d}"
            started[name] = time.time()
            joiners.append(NodeProcess.join(name, base, *node_args(len(nodes), args), "--peer", address, env=env))
        nodes.extend(joiners)
        return cls(round_no, killed, survivors, joiners, started)

    def report(self, args: argparse.Namespace) -> str:
        """Survivors' rounds after the churn (full share) and each joiner's first round."""
        survivors = self.survivors
        lines = [f"  churn: {', '.join(n.name for n in self.killed)} killed in round {self.round_no}"]
        for r in range(self.round_no, args.rounds):
            entries = [e for node in survivors for e in node.rounds if e["round"] == r]
            full = sum(e["outcome"] == "full" for e in entries)
            lines.append(f"    round {r}: {full}/{len(survivors)} survivors full")
        for joiner in self.joiners:
            first = next(iter(joiner.rounds), None)
            if first is None:
                lines.append(f"    {joiner.name}: no round averaged")
            else:
                took = first["time"] - self.started[joiner.name]
                lines.append(
                    f"    {joiner.name}: first round {first['round']} {first['outcome']}, {took:.1f}s after its start"
                )
        return "\n".join(lines)


def run_size(n: int, args: argparse.Namespace, base: Path) -> Row:
    env = {"OMP_NUM_THREADS": "1", **step_floor(args.step_floor)}
    common = node_args(n, args)
    started = time.monotonic()
    first = NodeProcess.join("n00", base, *common, env=env)
    nodes = [first]
    sampler = Sampler(nodes)
    sampler.start()
    try:
        address = first.wait_for_line(r"dtnode join --peer (\S+)", 900).group(1)
        for i in range(1, n - 1):
            nodes.append(NodeProcess.join(f"n{i:02d}", base, *common, "--peer", address, env=env))
        # n - 1 nodes up, waiting for the last one (--min-peers n): the swarm's cost while nothing happens
        wait_until(lambda: all(is_up(node) and node.status() for node in nodes), 900, "every node's /status")
        idle_from = time.monotonic()
        sampler.sample()
        time.sleep(args.idle_seconds)
        sampler.sample()
        idle = (idle_from, time.monotonic(), sampler.peak_pss)
        before = dict(sampler.last)  # the counters at the start of training: startup is not a round's
        nodes.append(NodeProcess.join(f"n{n - 1:02d}", base, *common, "--peer", address, env=env))
        deadline = time.monotonic() + args.cap_s
        if args.churn:
            churn = Churn.during(nodes, args, base, address, env, deadline)  # the sampler reads the joiners too
        for node in nodes:
            try:
                code = node.wait(max(deadline - time.monotonic(), 0.1))
            except AssertionError:  # capped: the rounds count up to now
                print(f"  n={n}: capped after {args.cap_s:.0f}s, {node.name} still running", file=sys.stderr)
                break
            if code != 0:
                print(f"  {node.name} exited {code}: {node.output[-1500:]}", file=sys.stderr)
    finally:
        sampler.stop()
        for node in sampler.nodes:
            node.kill()
    if args.churn:
        print(churn.report(args), flush=True)
        nodes = churn.survivors  # the row below: the nodes that ran every round
    histories = {node.name: [r for r in node.rounds if r["round"] < args.rounds] for node in nodes}
    rounds = RoundTally.of(histories)
    if args.per_round:
        print("\n".join(round_lines(rounds.by_round, len(nodes))), flush=True)
    per_hop = [
        e["phases_s"]["matchmaking"] / len(e["groups"])
        for entries in histories.values()
        for e in entries
        if e["groups"]
    ]
    net_per_hop = [
        (e["phases_s"]["matchmaking"] - e.get("matchmaking_waited_s", 0.0)) / len(e["groups"])
        for entries in histories.values()
        for e in entries
        if e["groups"]
    ]
    done = max(len(rounds.rounds), 1)
    last = [sampler.last.get(node.name, Reading()) for node in nodes]
    first = [before.get(node.name, Reading()) for node in nodes]
    return Row(
        n=n,
        rounds=len(rounds.rounds),
        full=sum(rounds.full) / done,
        agree=sum(rounds.agreed) / done,
        most_hashes=max(rounds.hashes, default=0),
        mm_p50=percentile(per_hop, 0.5),
        mm_p95=percentile(per_hop, 0.95),
        net_p95=percentile(net_per_hop, 0.95),
        dht_requests=statistics.median(b.dht_requests - a.dht_requests for a, b in zip(first, last)) / done,
        membership_gets=statistics.median(b.membership_gets - a.membership_gets for a, b in zip(first, last)) / done,
        dht_unanswered=statistics.median(b.dht_unanswered - a.dht_unanswered for a, b in zip(first, last)) / done,
        dht_kb=statistics.median(b.dht_io - a.dht_io for a, b in zip(first, last)) / done / 1e3,
        resyncs=statistics.median(b.resyncs - a.resyncs for a, b in zip(first, last)) / done,
        rss_mb=statistics.median(r.rss for r in last) / 2**20,
        pss_mb=statistics.median(r.pss for r in last) / 2**20,
        peak_pss_gb=sampler.peak_pss / 2**30,
        idle_cores=sampler.cores_between(idle[0], idle[1]),
        idle_pss_gb=idle[2] / 2**30 * n / max(n - 1, 1),
        tracebacks=sum("Traceback" in node.output for node in sampler.nodes),  # killed and joined ones too
        wall_s=time.monotonic() - started,
    )


@dataclass
class RoundTally:
    """The rounds a run's histories count, and which of them were full and agreed."""

    by_round: dict[int, list[dict]]  # every node's entry of each round
    rounds: list[int]  # every round up to the last one each node reached
    full: list[bool]  # per round: every node has an entry, and each ended `full`
    hashes: list[int]  # per round: the distinct θ_g its entries hold
    agreed: list[bool]  # per round: every node has an entry, all on one θ_g

    @classmethod
    def of(cls, histories: dict[str, list[dict]]) -> RoundTally:
        """A node with no entry for a round (it fell behind and caught up past it by a download)
        makes that round neither full nor agreed: counting only the rounds every node has an
        entry for, a round that 8 of 32 nodes skipped dropped out of the table."""
        by_round: dict[int, list[dict]] = {}
        for entries in histories.values():
            for entry in entries:
                by_round.setdefault(entry["round"], []).append(entry)
        reached = min((max((e["round"] for e in entries), default=-1) for entries in histories.values()), default=-1)
        rounds = [r for r in sorted(by_round) if r <= reached]
        everyone = [len(by_round[r]) == len(histories) for r in rounds]
        full = [whole and all(e["outcome"] == "full" for e in by_round[r]) for r, whole in zip(rounds, everyone)]
        hashes = [len({e["params_sha256"] for e in by_round[r]}) for r in rounds]
        agreed = [whole and h == 1 for h, whole in zip(hashes, everyone)]
        return cls(by_round, rounds, full, hashes, agreed)


def round_lines(by_round: dict[int, list[dict]], nodes: int) -> list[str]:
    """One line per round: how many nodes ended it `full`, the θ_g it ended on (how many nodes
    hold each), why the others did not (their history's `reasons`; `alone` for a node whose
    only shortfall was a group of one where its cell had more), and the medians of its
    matchmaking and all-reduce phases: where a run's misses fall, read from the histories alone."""
    lines = []
    for r in sorted(by_round):
        entries = by_round[r]
        holders = sorted(Counter(e["params_sha256"] for e in entries).values(), reverse=True)
        reasons = Counter(reason for e in entries if e["outcome"] != "full" for reason in e["reasons"] or ["alone"])
        lines.append(
            f"  round {r}: {sum(e['outcome'] == 'full' for e in entries)}/{len(entries)} full"
            + (f" ({nodes - len(entries)} without this round)" if len(entries) < nodes else "")
            + f", {len(holders)} θ_g {tuple(holders) if len(holders) > 1 else ''}".rstrip()
            + (f", not full: {dict(sorted(reasons.items()))}" if reasons else "")
            + f"; matchmaking {statistics.median(e['phases_s']['matchmaking'] for e in entries):.1f}s,"
            f" all-reduce {statistics.median(e['phases_s']['allreduce'] for e in entries):.1f}s (medians)"
        )
    return lines


HEADER = (
    f"{'n':>3} {'rounds':>6} {'full':>6} {'agree':>6} {'hashes':>6} {'mm p50':>7} {'mm p95':>7} {'net p95':>7} "
    f"{'dht req':>8} {'mem get':>7} {'unans':>5} {'dht kB':>8} {'resync':>6} {'rss MB':>7} {'pss MB':>7} {'peak pss':>9} "
    f"{'idle pss':>9} {'idle cores':>10} {'tracebacks':>10} {'wall':>6}"
)


def line(row: Row) -> str:
    return (
        f"{row.n:>3} {row.rounds:>6} {row.full:>6.0%} {row.agree:>6.0%} {row.most_hashes:>6} "
        f"{row.mm_p50:>6.2f}s {row.mm_p95:>6.2f}s {row.net_p95:>6.2f}s {row.dht_requests:>8.1f} {row.membership_gets:>7.1f} "
        f"{row.dht_unanswered:>5.1f} {row.dht_kb:>8.1f} "
        f"{row.resyncs:>6.2f} {row.rss_mb:>7.0f} {row.pss_mb:>7.0f} {row.peak_pss_gb:>7.2f}GB "
        f"{row.idle_pss_gb:>7.2f}GB {row.idle_cores:>10.2f} {row.tracebacks:>10} {row.wall_s:>5.0f}s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8,16,24,32", help="swarm sizes to run, one run each")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per run")
    parser.add_argument("--round-seconds", type=float, default=20.0, help="each round's inner steps, in seconds")
    parser.add_argument(
        "--step-floor",
        type=float,
        default=1.0,
        help="the least seconds of an inner step (a test hook that sleeps): n nodes' training leaves the cores "
        "to what is measured; 0 trains flat out",
    )
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="n - 1 waiting nodes sampled this long")
    parser.add_argument(
        "--cap-s", type=float, default=900.0, help="the most a run's rounds may take, once all nodes are up"
    )
    parser.add_argument("--keep", type=Path, help="keep every node's state dir (and history.jsonl) here")
    parser.add_argument(
        "--allreduce-timeout-min",
        type=float,
        default=0.0,
        help="the nodes' --allreduce-timeout-min (0: their default): n nodes on one box starve one another's "
        "streams for seconds, which hosts of their own do not",
    )
    parser.add_argument(
        "--per-round",
        action="store_true",
        help="before each size's row, a line per round: nodes full, the θ_g they ended on, why the rest were not",
    )
    parser.add_argument("--churn", type=int, default=0, help="nodes killed mid-round, and as many joining then")
    parser.add_argument(
        "--churn-round", type=int, default=-1, help="the round whose inner steps the churn cuts (default: rounds / 2)"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"n tiny nodes on {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
        f"groups of {GROUP_SIZE}, {args.rounds} rounds of {args.round_seconds:g}s inner steps each, "
        f"steps of {args.step_floor:g}s at least"
        + (f", all-reduce deadlines of {args.allreduce_timeout_min:g}s at least" if args.allreduce_timeout_min else "")
        + (f", {args.churn} nodes replaced mid-round" if args.churn else ""),
        flush=True,
    )
    print(HEADER, flush=True)
    for n in sizes:
        if args.keep:
            base = args.keep / f"n{n}"
            base.mkdir(parents=True, exist_ok=True)
            row = run_size(n, args, base)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                row = run_size(n, args, Path(tmp))
        print(line(row), flush=True)


if __name__ == "__main__":
    main()
