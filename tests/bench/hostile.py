"""Hostile peer: what one attacker, outsider or dead member does to an honest swarm, per attack and mode.

    .venv/bin/python -m tests.bench.hostile                     # about 60 min on 2 cores (both modes)
    .venv/bin/python -m tests.bench.hostile --modes mean --attacks clean,hostile-leader,kill

Each run is a swarm of `--honest` real `tiny` nodes and one more node running the same build
with a hostile failpoint armed from round 1 on (peers/failpoints.py, daemon/swarm/hostile.py):

- `hostile-delta` sends Δ x1000; `hostile-weight` the same Δ with a 1e11-token registration and
  1e12-weight streams; `hostile-resync` asks every group for a θ_g re-sync and sends θ_g x1000
  with weight 1e12; `hostile-bandwidth` the Δ x1000 advertising 1e9 Mbit/s; `hostile-pacing` a
  record claiming 1e11 tokens per round and 2^40 per step;
- `hostile-leader` registers as the group's first and never closes it; `hostile-pair` closes a
  backdated list naming itself and one victim and re-syncs that pair to -2.5 θ (it sends 2T - θ);
  `hostile-zero-weight` announces a weight of 0 and streams Δ x1000 at weight 1e12;
- `hostile-shadow` stores plain values under the swarm's keys; `hostile-pinning` pins every
  step of every sidecar, several times a second; `hostile-slots` holds 24 silent streams open
  to every peer; `hostile-donors` serves θ_g + 1 under five names of its host (a late honest
  joiner arrives in round 2 to be fooled);
- `kill`: no attacker; the extra node is honest and killed (`grouped@0`: its round-0 group
  formed, before its first stream; no rate is measured yet, so the deadline is its bound).

`clean` has no attacker: the baseline, run once per mode and repeat with the same number of
nodes (the extra node honest). `clean-joiner` is `clean` with the same late honest joiner as
`hostile-donors`, whose rounds per minute are compared with it (a download costs the swarm time
with or without an attacker); every other attack is compared with `clean`. A run ends when its nodes exit after `--rounds` rounds, or at `--cap-s`.

Printed per attack and mode: the honest nodes' outer rounds per minute from the end of round 0
on (the attack starts in round 1), counting only rounds averaged with another peer in every hop, and their ratio to the clean run's; the held-out loss of node
0's last θ_g and its ratio to the clean run's; whether every honest θ_g stayed within the bound
(each outer step, and the distance between two honest nodes' θ_g of one step, at most BOUND x
the clean run's largest honest outer step); the honest nodes' peak resident memory; and, for
`kill`, how much longer the survivors' round 0 took than the clean run's round 0.
Targets (ISSUE 56): rounds per minute >= 0.8 x clean under every attack, every θ_g bounded, and
the kill's round at most 5 s longer than a clean one.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes import NodeProcess, theta, wait_until

from tests.bench.convergence import RUN_ID, Config, final_loss_of

OLD_ATTACKS = "hostile-delta,hostile-weight,hostile-resync,hostile-bandwidth,hostile-pacing"
NEW_ATTACKS = (
    "hostile-leader,hostile-pair,hostile-zero-weight,hostile-shadow,hostile-donors,hostile-pinning,hostile-slots"
)
ATTACKS = f"clean,{OLD_ATTACKS},{NEW_ATTACKS},kill,clean-joiner"
# an attack measured against a baseline with the same honest work: the donors' victim is a late
# joiner, whose download and first rounds cost the swarm time with or without an attacker
BASELINE = {"hostile-donors": "clean-joiner"}
BOUND = 4.0  # an honest outer step (or two honest θ_g of one step) may be this many times the clean run's largest
KILL_ROUND = 0  # before any all-reduce rate is measured: the deadline is --allreduce-timeout
JOINER_AFTER_ROUND = 2  # hostile-donors: the late honest joiner starts once node 0 ended this round


@dataclass
class Outcome:
    attack: str
    mode: str
    loss: float
    rounds_per_min: float  # honest outer rounds per minute from the end of round 0 on
    max_step: float  # the largest ||θ_g(r) - θ_g(r-1)|| of any honest node
    spread: float  # the largest ||θ_g(node i, s) - θ_g(node 0, s)|| over honest nodes and steps
    peak_rss_mb: float  # the largest resident memory of an honest node's process
    kill_round_s: float | None  # the honest nodes' round KILL_ROUND, median seconds (the kill's, in `kill`)
    tracebacks: int  # honest nodes whose log holds a traceback
    rate_range: tuple[float, float] = (0.0, 0.0)  # with --repeat: the lowest and highest run's rounds/min


def combined(runs: list[Outcome]) -> Outcome:
    """One row from the repeats of one attack and mode: the median rate and loss, the worst bound,
    memory and tracebacks (a row is only as safe as its worst run)."""
    kills = [o.kill_round_s for o in runs if o.kill_round_s is not None]
    rates = [o.rounds_per_min for o in runs]
    return Outcome(
        runs[0].attack,
        runs[0].mode,
        statistics.median(o.loss for o in runs),
        statistics.median(rates),
        max(o.max_step for o in runs),
        max(o.spread for o in runs),
        max(o.peak_rss_mb for o in runs),
        statistics.median(kills) if kills else None,
        sum(o.tracebacks for o in runs),
        (min(rates), max(rates)),
    )


class PeakMemory:
    """Samples the resident memory of processes every second, keeping each one's peak."""

    def __init__(self, nodes: list[NodeProcess]):
        self.nodes, self.peak = nodes, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            for node in list(self.nodes):
                try:
                    self.peak = max(self.peak, psutil.Process(node.proc.pid).memory_info().rss / 2**20)
                except psutil.Error:
                    continue

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def common_args(args: argparse.Namespace, cfg: Config, mode: str) -> list[str]:
    common = [
        "--run-id",
        RUN_ID,  # the convergence benchmark's: its held-out set is of the same synthetic language
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--inner-steps",
        str(args.inner_steps),
        "--max-rounds",
        str(args.rounds),
        "--total-steps",
        str(args.rounds * args.inner_steps),
        "--warmup-steps",
        str(args.inner_steps),
        "--min-peers",
        str(args.honest + 1),
        "--target-group-size",  # room for the late joiner of `hostile-donors` too: every run one group
        str(args.honest + 2),
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "1000",
        "--eval-sequences",
        str(cfg.eval_sequences),
        "--no-fused-kernels",
        "--join-timeout",
        "120",
    ]
    if mode == "trimmed-mean":
        common += ["--aggregation", "trimmed-mean"]
    return common


def start(attack: str, mode: str, args: argparse.Namespace, base: Path, cfg: Config) -> tuple[list, list, float]:
    """The swarm of one run: (honest nodes, every node, when round 0 may end at the earliest)."""
    common = common_args(args, cfg, mode)
    env = {"OMP_NUM_THREADS": "1"}
    extra_env = env
    if attack == "kill":
        extra_env = {**env, "DTNODE_TEST_FAILPOINT": f"grouped@{KILL_ROUND}"}
    elif attack not in ("clean", "clean-joiner"):
        extra_env = {**env, "DTNODE_TEST_FAILPOINT": f"{attack}@1"}
    first = NodeProcess.join("n0", base, *common, env=env)
    address = first.wait_for_line(r"dtnode join --peer (\S+)", 600).group(1)
    honest = [
        first,
        *(NodeProcess.join(f"n{i}", base, *common, "--peer", address, env=env) for i in range(1, args.honest)),
    ]
    extra = NodeProcess.join(
        "extra" if attack in ("clean", "clean-joiner", "kill") else "attacker",
        base,
        *common,
        "--peer",
        address,
        env=extra_env,
    )
    nodes = [*honest, extra]
    if attack in ("clean", "clean-joiner"):
        honest = nodes  # the extra node is honest: it counts like the others
    if attack in ("hostile-donors", "clean-joiner"):
        wait_until(lambda: first.round(JOINER_AFTER_ROUND), 600, f"round {JOINER_AFTER_ROUND} of n0")
        joiner_args = list(common)
        joiner_args[joiner_args.index("--min-peers") + 1] = "1"  # a joiner waits for no --min-peers
        late = NodeProcess.join("late", base, *joiner_args, "--peer", address, env=env)
        nodes.append(late)
        honest = [*honest, late]
    return honest, nodes, time.monotonic()


def averaged(entry: dict) -> bool:
    """Whether a round's average met at least one other peer in every hop (alone is no swarm)."""
    return bool(entry["groups"]) and all(size >= 2 for size, _ in entry["groups"])


def rounds_per_minute(node: NodeProcess, capped_at: float) -> float | None:
    """Outer rounds averaged with others (`averaged`) per minute after round 0's end, up to the
    node's last round if it finished, or up to `capped_at` (wall time: the run's cap) if not."""
    rounds = node.rounds
    first = next((r for r in rounds if r["round"] == 0), None)
    later = [r for r in rounds if r["round"] >= 1]
    if first is None:
        return None
    finished = node.proc.poll() == 0
    end = later[-1]["time"] if finished and later else capped_at
    return 60 * sum(averaged(r) for r in later) / max(end - first["time"], 1e-9)


def theta_bounds(nodes: list[NodeProcess]) -> tuple[float, float]:
    """(largest outer step of any node, largest distance of a node's θ_g from node 0's at one step)."""
    max_step, spread = 0.0, 0.0
    reference = nodes[0].state_dir
    reference_steps = {int(p.stem.split("-")[-1]) for p in reference.glob("ckpt-*.safetensors")}
    for node in nodes:
        steps = sorted(int(p.stem.split("-")[-1]) for p in node.state_dir.glob("ckpt-*.safetensors"))
        for a, b in itertools.pairwise(steps):
            max_step = max(max_step, float((theta(node.state_dir, b) - theta(node.state_dir, a)).norm()))
        if node.state_dir != reference:
            for step in set(steps) & reference_steps:
                spread = max(spread, float((theta(node.state_dir, step) - theta(reference, step)).norm()))
    return max_step, spread


def run(attack: str, mode: str, args: argparse.Namespace, workdir: Path, cfg: Config) -> Outcome:
    base = workdir / f"{attack}-{mode}"
    honest, nodes, _ = start(attack, mode, args, base, cfg)
    memory = PeakMemory(honest)
    deadline = time.monotonic() + args.cap_s
    try:
        for node in honest:
            try:
                node.proc.wait(max(deadline - time.monotonic(), 0.1))
            except Exception:  # noqa: BLE001  (capped: the rates count up to now)
                break
        capped_at = time.time()
        peak = memory.stop()
        rates = [
            rate for node in honest if node.name != "late" and (rate := rounds_per_minute(node, capped_at)) is not None
        ]
    finally:
        for node in nodes:
            node.kill()
    for node in nodes:
        node.wait(30)
        if node.state_dir.is_dir():
            (node.state_dir / "node.log").write_text(node.output)
    max_step, spread = theta_bounds(honest)
    survivors = [r for node in honest if (r := node.round(KILL_ROUND)) is not None]
    kill_round = statistics.median(r["duration_s"] for r in survivors) if survivors else None
    return Outcome(
        attack,
        mode,
        final_loss_of(honest[0].state_dir, cfg, "synthetic", None),
        statistics.mean(rates) if rates else 0.0,
        max_step,
        spread,
        peak,
        kill_round,
        sum("Traceback" in node.output for node in honest),
    )


def report(outcomes: list[Outcome], args: argparse.Namespace) -> None:
    repeated = args.repeat > 1
    print(
        f"\n{args.honest} honest {args.model} peers + 1 attacker (or 1 more honest node: clean, kill), "
        f"{args.rounds} rounds of H={args.inner_steps}, batch {args.batch_size}x{args.seq_len}, cap {args.cap_s:g}s; "
        f"bound: {BOUND:g}x the clean run's largest honest outer step"
        + (
            f"; per row the median of {args.repeat} runs (rounds/min lowest-highest), the worst bound"
            if repeated
            else ""
        )
    )
    print(
        f"{'mode':<13}{'attack':<21}{'rounds/min':>11}{'vs clean':>9}"
        + (f"{'range':>14}" if repeated else "")
        + f"{'held-out':>10}{'vs clean':>9}"
        f"{'max step':>10}{'spread':>10}{'bounded':>8}{'peak RSS':>10}{'kill round':>16}{'tracebacks':>11}"
    )
    for o in outcomes:
        clean = next(c for c in outcomes if c.mode == o.mode and c.attack == "clean")
        baseline = next((c for c in outcomes if c.mode == o.mode and c.attack == BASELINE.get(o.attack)), clean)
        bounded = "yes" if max(o.max_step, o.spread) <= BOUND * clean.max_step else "NO"
        kill = "-"
        if o.attack == "kill" and o.kill_round_s is not None and clean.kill_round_s is not None:
            kill = f"{o.kill_round_s:.1f}s ({o.kill_round_s - clean.kill_round_s:+.1f})"
        spread_of_rates = f"{o.rate_range[0]:>7.2f}-{o.rate_range[1]:<6.2f}" if repeated else ""
        print(
            f"{o.mode:<13}{o.attack:<21}{o.rounds_per_min:>11.2f}{o.rounds_per_min / max(baseline.rounds_per_min, 1e-9):>8.2f}x"
            f"{spread_of_rates}{o.loss:>10.4f}{o.loss / clean.loss:>8.3f}x{o.max_step:>10.3g}{o.spread:>10.3g}{bounded:>8}"
            f"{o.peak_rss_mb:>8.0f}MB{kill:>16}{o.tracebacks:>11}"
        )
    for attack, base in BASELINE.items():
        if any(o.attack == base for o in outcomes):
            print(f"{attack}'s rounds/min ratio is against {base}, the clean run with the same late joiner")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=ATTACKS)
    parser.add_argument("--modes", default="mean,trimmed-mean")
    parser.add_argument("--honest", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    # H=50, DiLoCo's lower end: at H=10 a round of this host's tiny swarm lasts about 2 s, shorter
    # than a heartbeat, and any fixed grace of the protocol is a large share of it
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cap-s", type=float, default=240.0, help="a run stops here, finished or not")
    parser.add_argument("--eval-sequences", type=int, default=128)
    parser.add_argument("--keep", type=Path, help="keep every node's state dir and log here")
    parser.add_argument("--repeat", type=int, default=1, help="passes over the list; a row prints the median")
    args = parser.parse_args()
    cfg = Config(
        args.model, args.batch_size, args.seq_len, args.rounds * args.inner_steps, 1, 1e-3, 0.7, 0, 128, 1, "cpu"
    )
    cfg.eval_sequences = args.eval_sequences
    attacks = args.attacks.split(",")
    if "clean" not in attacks:
        attacks.insert(0, "clean")
    runs: dict[tuple[str, str], list[Outcome]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        for repeat in range(args.repeat):
            for mode in args.modes.split(","):
                for attack in attacks:
                    pass_dir = workdir / f"pass-{repeat}" if args.repeat > 1 else workdir
                    outcome = run(attack, mode, args, pass_dir, cfg)
                    print(
                        f"  {mode:<12} {attack:<20} {outcome.rounds_per_min:.2f} rounds/min  held-out {outcome.loss:.4f}",
                        flush=True,
                    )
                    runs.setdefault((mode, attack), []).append(outcome)
    report([combined(repeats) for repeats in runs.values()], args)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
