"""Consensus drift: how far apart do the θ_g of a moshpit swarm get over many outer steps?

    .venv/bin/python -m tests.bench.drift                    # 6 nodes, M=3 (d=2), 60 steps
    .venv/bin/python -m tests.bench.drift --consensus-every 0  # no θ_g re-sync: watch it grow
    .venv/bin/python -m tests.bench.drift --nodes 9 --steps 80 --error-feedback

Runs real node processes on loopback (tiny preset) and reads every node's checkpoint of
every outer step. Printed per step: the largest distance between a node's θ_g and the
swarm's mean θ_g, relative to |θ_g| and to the step's mean update |Δθ_g| (the mean's own fp32
rounding puts a floor of about 5e-8 under the first), and how many distinct θ_g the nodes
hold (1: the same bits everywhere). Bounded drift
is what moshpit averaging with one answer per group promises; growth would mean the int8
errors of different groups accumulate.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes import FAST, NodeProcess, theta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--error-feedback", action="store_true")
    parser.add_argument("--consensus-every", type=int, default=25, help="θ_g re-sync period (0: never)")
    args = parser.parse_args()
    extra = [
        "--target-group-size",
        str(args.group_size),
        "--max-rounds",
        str(args.steps),
        "--keep-checkpoints",
        str(args.steps + 5),
        "--min-peers",
        str(args.nodes),
        "--consensus-every",
        str(args.consensus_every),
    ]
    if args.error_feedback:
        extra.append("--error-feedback")
    with tempfile.TemporaryDirectory() as tmp:
        nodes = [NodeProcess.join("n0", Path(tmp), *FAST, *extra)]
        try:
            address = nodes[0].join_address
            nodes += [
                NodeProcess.join(f"n{i}", Path(tmp), *FAST, *extra, "--peer", address) for i in range(1, args.nodes)
            ]
            for node in nodes:
                assert node.wait(1800) == 0, node.output
        finally:
            for node in nodes:
                node.kill()
        print(
            f"{args.nodes} nodes, target group size {args.group_size}, {args.steps} outer steps, "
            f"error feedback {'on' if args.error_feedback else 'off'}, θ_g re-sync every {args.consensus_every or '-'}"
        )
        print(f"{'step':>5} {'max |θ_i - mean| / |θ|':>24} {'/ |mean update|':>16} {'distinct θ_g':>13}")
        rows = []
        previous = None
        for step in range(1, args.steps + 1):
            thetas = []
            for node in nodes:
                try:
                    thetas.append(theta(node.state_dir, step))
                except FileNotFoundError:  # a node that resynced past this step
                    pass
            stacked = torch.stack(thetas)
            mean = stacked.mean(0)
            spread = float((stacked - mean).norm(dim=1).max())
            update = float((mean - previous).norm()) if previous is not None else float("nan")
            previous = mean
            distinct = len({t.numpy().tobytes() for t in thetas})  # 1: every node holds the same bits
            rows.append(
                (
                    step,
                    spread / float(mean.norm()),
                    spread / update if not math.isnan(update) else float("nan"),
                    distinct,
                )
            )
        solo = sum(len([1 for line in n.lines if "| groups 1/" in line]) for n in nodes)
        # a group whose members' θ_g hashes differed re-synced θ_g and the momentum (8 bytes a
        # parameter) though no one asked: what a split costs when re-syncs are off
        diverged = sum(len([1 for line in n.lines if "though none asked for a re-sync" in line]) for n in nodes)
        for step, rel_theta, rel_update, distinct in rows:
            if (
                step <= 3
                or step % 10 == 0
                or step == args.steps
                or (args.consensus_every and step % args.consensus_every in (0, 1))
            ):
                print(f"{step:>5} {rel_theta:24.2e} {rel_update:16.3f} {distinct:>13}")
        late = [r[1] for r in rows[len(rows) // 2 :]]
        early = [r[1] for r in rows[1 : len(rows) // 2]]
        print(
            f"max over steps 2..{len(rows) // 2}: {max(early):.2e}; over the second half: {max(late):.2e}; "
            f"rounds with a solo first hop (all nodes): {solo}; steps whose θ_g all nodes share bit for bit: "
            f"{sum(r[3] == 1 for r in rows)} of {len(rows)}; re-syncs of diverged θ_g (all nodes): {diverged}"
        )


if __name__ == "__main__":
    main()
