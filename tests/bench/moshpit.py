"""Moshpit averaging simulated in one process: how fast do N peers reach the global mean?

    .venv/bin/python -m tests.bench.moshpit
    .venv/bin/python -m tests.bench.moshpit --peers 16,64 --group-sizes 2,4 --fail 0,0.1

The grouping is the daemon's own (`dtnode.peers.grid`: hashed cells reshuffled every outer
step, then the classes each group hands out, d hops per step, oversized groups split like the
matchmaker splits them); the
averaging is the exact weighted mean of each group's (mean, weight) pairs, as the butterfly
computes it before int8. A peer that fails a hop keeps its value and weight for that hop.
Printed: RMS distance of the peers' values to the initial global mean, relative to the
start, after each hop; the hops each scheme needs to get below epsilon, against an
all-reduce of everyone (one hop, if nobody fails) and random gossip pairs; and the hops
moshpit needs until the peers agree with each other within epsilon (what keeps θ_g in
consensus: with failures the swarm agrees on a mean that is slightly off the exact one).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from dtnode.peers.grid import coordinates, first_slot, grid_shape, hop_key, next_slots, split_groups
from dtnode.peers.hops import MAX_CHAINS


def distance(values: torch.Tensor, target: torch.Tensor, start: float) -> float:
    return float((values - target).pow(2).sum(1).mean().sqrt()) / start


def average_groups(values: torch.Tensor, weights: torch.Tensor, groups: list[list[int]]) -> None:
    for g in groups:
        if len(g) < 2:
            continue
        idx = torch.tensor(g)
        w = weights[idx]
        values[idx] = (values[idx] * w[:, None]).sum(0) / w.sum()
        weights[idx] = w.sum()


def moshpit(values, weights, group_size, fail, hops, gen) -> list[torch.Tensor]:
    """The daemon's grouping (`dtnode.peers.grid`): hop 0 by hashed cells, later hops by the
    classes each group hands out (a member of a small group stands in several classes and
    carries each result on, its own being the first); oversized groups split as the
    matchmaker splits them; a member brings its weight times its slot's share."""
    n = values.shape[0]
    ids = [f"peer{i:05d}" for i in range(n)]
    index = {p: i for i, p in enumerate(ids)}
    side, dims = grid_shape(n, group_size)
    curve: list[torch.Tensor] = []
    step = 0
    while len(curve) < hops:
        # each peer's chains: (slot, values, weight); hop 0 starts from its own
        chains = {p: [(first_slot(coordinates(p, step, side, dims)), values[index[p]].clone(), 1.0)] for p in ids}
        for hop in range(dims):
            alive = torch.rand(n, generator=gen) >= fail
            by_key: dict[str, list[tuple[str, int]]] = {}
            for p in ids:
                if alive[index[p]]:
                    for c, (slot, _, _) in enumerate(chains[p]):
                        by_key.setdefault(slot.key, []).append((p, c))
            after = {p: list(chains[p]) for p in ids}
            groups: dict[tuple[str, int], list[str]] = {}
            for entries in by_key.values():
                owners = {p: c for p, c in entries}  # one chain per peer and key
                for members in split_groups(owners, side):
                    contributions = [chains[p][owners[p]] for p in members]
                    w = torch.tensor([weight * slot.share for slot, _, weight in contributions])
                    stacked = torch.stack([v for _, v, _ in contributions])
                    mean = (stacked * w[:, None]).sum(0) / w.sum()
                    for p in members:
                        slot = chains[p][owners[p]][0]
                        after[p][owners[p]] = (slot, mean, float(w.sum()))
                        groups[(p, owners[p])] = members
            if hop + 1 < dims:
                chains = {
                    p: [
                        (nxt, v, weight)
                        for c, (slot, v, weight) in enumerate(after[p])
                        for nxt in (
                            next_slots(slot.coords, hop + 1, groups[(p, c)], p, side)
                            if (p, c) in groups
                            else [replace(slot, key=hop_key(slot.coords, hop + 1), share=1.0)]
                        )
                    ][:MAX_CHAINS]
                    for p in ids
                }
            else:
                chains = after
            for p in ids:
                values[index[p]] = chains[p][0][1]
            curve.append(values.clone())
            if len(curve) >= hops:
                break
        step += 1
    return curve


def gossip(values, fail, hops, gen) -> list[torch.Tensor]:
    n = values.shape[0]
    curve = []
    weights = torch.ones(n)
    for _ in range(hops):
        order = torch.randperm(n, generator=gen).tolist()
        alive = torch.rand(n, generator=gen) >= fail
        pairs = [[a, b] for a, b in zip(order[::2], order[1::2]) if alive[a] and alive[b]]
        average_groups(values, weights, pairs)
        weights.fill_(1.0)
        curve.append(values.clone())
    return curve


def everyone(values, fail, hops, gen) -> list[torch.Tensor]:
    n = values.shape[0]
    curve = []
    for _ in range(hops):
        alive = [i for i in range(n) if torch.rand(1, generator=gen).item() >= fail]
        average_groups(values, torch.ones(n), [alive])
        curve.append(values.clone())
    return curve


def hops_to(curve: list[float], eps: float) -> str:
    for i, d in enumerate(curve):
        if d <= eps:
            return str(i + 1)
    return f">{len(curve)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="16,64,256,1024", help="comma-separated swarm sizes N")
    parser.add_argument("--group-sizes", default="2,4,8,16", help="comma-separated target group sizes M")
    parser.add_argument("--fail", default="0,0.1", help="comma-separated failure rates per peer and hop")
    parser.add_argument("--dim", type=int, default=64, help="values per peer")
    parser.add_argument("--hops", type=int, default=24, help="hops simulated per scheme")
    parser.add_argument("--eps", type=float, default=1e-3, help="distance (relative to the start) counted as reached")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shown = 8
    print(f"hop k: moshpit's relative RMS distance to the global mean after k hops (eps = {args.eps:g})")
    print("moshpit, gossip, all: hops until within eps of the global mean; agreement: hops until the")
    print("moshpit peers are within eps of each other\n")
    head = f"{'N':>5} {'M':>3} {'d':>2} {'fail':>5}  " + " ".join(f"{'hop ' + str(h + 1):>8}" for h in range(shown))
    print(head + f"  {'moshpit':>8} {'gossip':>7} {'all':>5} {'agreement':>9}")
    print("-" * (len(head) + 45))
    for n in (int(x) for x in args.peers.split(",")):
        for m in (int(x) for x in args.group_sizes.split(",")):
            if m >= n:
                continue
            for fail in (float(x) for x in args.fail.split(",")):
                gen = torch.Generator().manual_seed(args.seed)
                start_values = torch.randn(n, args.dim, generator=gen)
                target = start_values.mean(0)
                start = float((start_values - target).pow(2).sum(1).mean().sqrt())
                curves = {}
                runs = {
                    "moshpit": lambda v, n=n, m=m, fail=fail, gen=gen: moshpit(
                        v, torch.ones(n), m, fail, args.hops, gen
                    ),
                    "gossip": lambda v, fail=fail, gen=gen: gossip(v, fail, args.hops, gen),
                    "all": lambda v, fail=fail, gen=gen: everyone(v, fail, args.hops, gen),
                }
                spread = []
                for name, fn in runs.items():
                    states = fn(start_values.clone())
                    curves[name] = [distance(v, target, start) for v in states]
                    if name == "moshpit":
                        spread = [distance(v, v.mean(0), start) for v in states]
                _, d = grid_shape(n, m)
                row = " ".join(f"{x:8.1e}" for x in curves["moshpit"][:shown])
                print(
                    f"{n:>5} {m:>3} {d:>2} {fail:>5.2f}  {row}  {hops_to(curves['moshpit'], args.eps):>8} "
                    f"{hops_to(curves['gossip'], args.eps):>7} {hops_to(curves['all'], args.eps):>5} "
                    f"{hops_to(spread, args.eps):>9}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
