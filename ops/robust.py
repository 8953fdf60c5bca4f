"""Robust aggregation: a coordinate-wise trimmed mean.

Chosen over CenteredClip because its guarantee needs no tuning and no iterations: with at
most `trim` hostile values per coordinate, every coordinate of the result lies between the
smallest and the largest honest value of that coordinate, however large the hostile values
are. So with 1 of 5 peers hostile and trim = 1, the result is never farther from the honest
mean, coordinate by coordinate, than the honest peer farthest from it. It is computed one
chunk at a time with a sort over the (small) group dimension, so it streams like the plain
mean. The values kept are averaged with their senders' token weights (which the group's plan
has already capped, peers/plan.py): the guarantee holds for any weights, since a weighted mean
of values inside the honest range stays inside it. The price: with no attacker it is slightly
noisier than the mean (it drops 2·trim of n honest values per coordinate).

The coordinate-wise median (`--aggregation median`) is the same rule trimmed as far as it goes
(MEDIAN_FRACTION): it bounds up to (n-1)/2 hostile members of a group of n, the trimmed mean
floor(fraction·n) (at least one from 3 up), and it is noisier still without an attacker.

The plain mean (`--aggregation mean`) is bounded too, by length rather than by coordinate
(`clip_to_median`): in every chunk of a part, a contribution longer than CLIP_REACH x the lower
median of the contributions' lengths is scaled down to that. The reducer does it, so every
member of the group receives the same clipped mean and honest θ_g stay one: a bound each node
took on its own (daemon/training/update_bounds.py) scaled the same attacker-made mean by each
node's own factor and split them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# `--aggregation median`: the most a trim may take (see trim_count), which leaves the middle
# value (odd counts) or the two middle values (even counts): the coordinate-wise median
MEDIAN_FRACTION = 0.4999


# the plain mean's bound: how many times the lower median of a chunk's contribution lengths one
# contribution may be long. Honest peers that trained a round's share from one θ_g send Δ of
# similar length (within tens of percent); 2x leaves them untouched and holds one member of a
# group of n to moving the mean by at most about 2/n of a typical Δ.
CLIP_REACH = 2.0


def lower_median(values: Iterable[float]) -> float:
    """The lower median (of an even count, the smaller middle value; 0.0 of none): what a peer's
    report or weight is bounded by, so that in a pair the smaller, honest one bounds the other."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def upper_median(values: Iterable[float]) -> float:
    """The upper median (of an even count, the larger middle value; 0.0 of none): what a typical
    peer trained, for an allowance. One value moves it no further than another value, and in a
    pair it is the larger: an honest peer that trained more than its partner is the typical one."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def clip_to_median(rows: torch.Tensor, reach: float = CLIP_REACH) -> int:
    """Scale down in place every row of `rows` (contributors, values) whose length is over
    `reach` x the lower median of the non-zero rows' lengths; returns how many were scaled.

    A row is its sender's values over one chunk, so the bound holds for a sender's whole part
    too (its squared length is the sum of its chunks'), and since every chunk's median is some
    contributor's length, one hostile member of a group with an honest majority is held to
    `reach` x an honest length in every chunk. In a pair the lower median is the shorter of
    the two: a member can shrink its partner's Δ to its own (a round lost, never a step
    steered), and cannot stretch its own past `reach` x its partner's. Each row's length is its
    own reduction, so the set of rows decides the result, not their order.
    Rows of length 0 (a peer that trained nothing) neither count in the median nor are scaled.
    """
    if rows.shape[0] < 2 or rows.shape[1] == 0:
        return 0
    lengths = torch.linalg.vector_norm(rows, dim=1).tolist()
    limit = reach * lower_median(length for length in lengths if length > 0)
    scaled = 0
    for row, length in zip(rows, lengths, strict=True):
        if length > limit > 0:
            row.mul_(limit / length)
            scaled += 1
    return scaled


def trim_count(contributors: int, fraction: float) -> int:
    """Values dropped at each end per coordinate: floor(fraction·n), at least one from 3
    contributors up (a group of 3 or 4 is where moshpit groups live, and floor(0.2·4) would
    trim nothing there: one hostile member would move the mean as far as it liked), keeping
    at least one value."""
    if contributors < 1 or not 0 <= fraction < 0.5:
        raise ValueError("need at least one contributor and 0 <= fraction < 0.5")
    floor = 1 if contributors >= 3 and fraction > 0 else 0
    return min(max(int(contributors * fraction), floor), (contributors - 1) // 2)


def trimmed_mean(
    stacked: torch.Tensor, trim: int, out: torch.Tensor | None = None, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over dim 0 of `stacked` (contributors, values) after dropping the `trim` smallest
    and `trim` largest value of every coordinate; weighted by `weights` (one positive weight per
    contributor) when given."""
    n = stacked.shape[0]
    if trim < 0 or n - 2 * trim < 1:
        raise ValueError(f"cannot trim {trim} from each end of {n} values")
    if not bool(torch.isfinite(stacked).all()):
        raise ValueError("non-finite values")
    if weights is None:
        kept = stacked.sort(dim=0).values[trim : n - trim]
        return _exact_where_equal(kept, kept.mean(dim=0), out)
    if weights.shape != (n,) or not bool((weights > 0).all()) or not bool(torch.isfinite(weights).all()):
        raise ValueError("need one finite, positive weight per contributor")
    # rows by weight, then a stable sort by value: each coordinate's values in (value, weight)
    # order, which does not depend on the order of the rows, so neither do the trimmed set and
    # the sums' bits (two moshpit groups reducing the same contributions agree)
    by_weight = torch.argsort(weights, stable=True)
    stacked, weights = stacked[by_weight], weights[by_weight]
    ordered, order = stacked.sort(dim=0, stable=True)
    kept = ordered[trim : n - trim]
    w = weights.to(stacked.dtype)[order[trim : n - trim]]  # each kept value's sender's weight
    return _exact_where_equal(kept, (kept * w).sum(dim=0).div_(w.sum(dim=0)), out)


def _exact_where_equal(kept: torch.Tensor, mean: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`mean`, except where every kept value of a coordinate is one value: that value, bit for
    bit (w·x/w, or (x+x+x)/3, is not always x in fp32). A group whose members all brought the
    same mean (a later hop of an uneven grid) then holds it as a peer alone with it does, and
    the swarm keeps one θ_g; the plain mean does the same (ops/ordered_mean.py). `kept` is
    sorted along dim 0, so its first and last rows are equal exactly where all rows are. Zeros
    keep the sum's rule: -0.0 == 0.0, and which of them a sort puts first depends on the rows'
    order, which the sum's result (0.0 from any mix) does not."""
    exact = torch.where((kept[0] == kept[-1]) & (kept[0] != 0), kept[0], mean)
    return out.copy_(exact) if out is not None else exact
