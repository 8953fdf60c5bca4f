"""Hostile peer: what one attacker among honest peers does to their model, per attack and mode.

    .venv/bin/python -m tests.bench.hostile                     # about 8 min on 2 cores
    .venv/bin/python -m tests.bench.hostile --modes mean --attacks clean,hostile-weight

Each run is a swarm of `--honest` real `tiny` nodes and one more node running the same build
with a hostile failpoint armed from round 1 on (peers/failpoints.py: `hostile-delta` sends Δ
x1000, `hostile-weight` the same Δ with a 1e11-token registration and 1e12-weight streams,
`hostile-resync` asks every group for a θ_g re-sync and sends θ_g x1000 with weight 1e12,
`hostile-bandwidth` the Δ x1000 advertising 1e9 Mbit/s, `hostile-pacing` a record claiming
1e11 tokens per round and 2^40 per step). `clean` has no attacker: the baseline, run once per
mode with the same number of nodes (the extra node honest).

Modes: `mean` (the default weighted mean) and `trimmed-mean` (--aggregation trimmed-mean,
robust to a minority of hostile senders).

Printed per attack and mode: the honest nodes' held-out loss of θ_g after the last round (node
0's, the same function as tests.bench.convergence), its ratio to the clean run's, the honest
inner steps per round (pacing), and whether any honest θ_g moved by more than the bound in any
outer step: the bound is BOUND x the largest outer step of any honest node in the clean run of
that mode. A "no" there is an attack the mode does not bound.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes import NodeProcess, run_swarm, theta

from tests.bench.convergence import RUN_ID, Config, final_loss_of

ATTACKS = "clean,hostile-delta,hostile-weight,hostile-resync,hostile-bandwidth,hostile-pacing"
BOUND = 4.0  # an honest outer step may be this many times the clean run's largest


@dataclass
class Outcome:
    attack: str
    mode: str
    loss: float
    max_step: float  # the largest ||θ_g(r) - θ_g(r-1)|| of any honest node
    steps_per_round: float  # honest inner steps per round, on average
    wall_s: float
    tracebacks: int  # honest nodes whose log holds a traceback


def run(attack: str, mode: str, args: argparse.Namespace, workdir: Path, cfg: Config) -> Outcome:
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
        "--target-group-size",
        str(args.honest + 1),
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
    base = workdir / f"{attack}-{mode}"
    env = {"OMP_NUM_THREADS": "1"}
    hostile_env = {**env, "DTNODE_TEST_FAILPOINT": f"{attack}@1"} if attack != "clean" else env
    started = time.monotonic()
    nodes = run_swarm(
        NodeProcess.join("n0", base, *common, env=env),
        lambda address: [
            *(NodeProcess.join(f"n{i}", base, *common, "--peer", address, env=env) for i in range(1, args.honest)),
            NodeProcess.join("attacker", base, *common, "--peer", address, env=hostile_env),
        ],
    )
    wall = time.monotonic() - started
    for node in nodes:
        (node.state_dir / "node.log").write_text(node.output)
    honest = nodes[: args.honest]
    max_step = 0.0
    for node in honest:
        steps = sorted(int(p.stem.split("-")[-1]) for p in node.state_dir.glob("ckpt-*.safetensors"))
        for a, b in itertools.pairwise(steps):
            max_step = max(max_step, float((theta(node.state_dir, b) - theta(node.state_dir, a)).norm()))
    rounds = [node.rounds for node in honest]
    inner = [r["inner_steps"] for rs in rounds for r in rs if r.get("inner_steps") is not None]
    return Outcome(
        attack,
        mode,
        final_loss_of(honest[0].state_dir, cfg, "synthetic", None),
        max_step,
        sum(inner) / max(len(inner), 1),
        wall,
        sum("Traceback" in node.output for node in honest),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=ATTACKS)
    parser.add_argument("--modes", default="mean,trimmed-mean")
    parser.add_argument("--honest", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--eval-sequences", type=int, default=128)
    parser.add_argument("--keep", type=Path, help="keep every node's state dir and log here")
    args = parser.parse_args()
    cfg = Config(
        args.model, args.batch_size, args.seq_len, args.rounds * args.inner_steps, 1, 1e-3, 0.7, 0, 128, 1, "cpu"
    )
    cfg.eval_sequences = args.eval_sequences
    attacks = args.attacks.split(",")
    if "clean" not in attacks:
        attacks.insert(0, "clean")
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        for mode in args.modes.split(","):
            for attack in attacks:
                outcome = run(attack, mode, args, workdir, cfg)
                print(f"  {mode:<12} {attack:<18} held-out {outcome.loss:.4f}  {outcome.wall_s:.0f}s", flush=True)
                outcomes.append(outcome)
    print(
        f"\n{args.honest} honest {args.model} peers + 1 attacker, {args.rounds} rounds of H={args.inner_steps}, "
        f"batch {args.batch_size}x{args.seq_len}; bound: {BOUND:g}x the clean run's largest honest outer step"
    )
    print(
        f"{'mode':<13}{'attack':<19}{'held-out':>10}{'vs clean':>10}{'steps/round':>12}"
        f"{'max step':>10}{'bounded':>9}{'tracebacks':>11}"
    )
    for o in outcomes:
        clean = next(c for c in outcomes if c.mode == o.mode and c.attack == "clean")
        bounded = "yes" if o.max_step <= BOUND * clean.max_step else "NO"
        print(
            f"{o.mode:<13}{o.attack:<19}{o.loss:>10.5g}{o.loss / clean.loss:>9.4g}x{o.steps_per_round:>12.1f}"
            f"{o.max_step:>10.3g}{bounded:>9}{o.tracebacks:>11}"
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
