"""How a flat buffer is cut into parts, one per reducer.

Parts are proportional to each reducer's bandwidth and aligned to the quantization block,
so no block straddles two reducers. Every member computes the same plan from the same
inputs, which is what lets a group agree on it without a leader.
"""

from __future__ import annotations

import math


def plan_parts(total: int, shares: list[float], align: int = 1) -> list[tuple[int, int]]:
    """Split [0, total) into len(shares) contiguous (offset, length) parts.

    Shares of 0 get empty parts (client-mode peers). Rounding is absorbed by the last
    reducer with a positive share, so the parts always cover the buffer exactly.
    """
    if total < 0 or align < 1:
        raise ValueError("total must be >= 0 and align >= 1")
    if not shares or any(s < 0 or math.isnan(s) for s in shares):
        raise ValueError("shares must be non-negative numbers")
    positive = [i for i, s in enumerate(shares) if s > 0]
    if not positive:
        raise ValueError("at least one reducer needs a positive share")
    blocks = -(-total // align)
    weight_sum = sum(shares[i] for i in positive)
    lengths = [0] * len(shares)
    cumulative = 0.0
    given = 0
    for i in positive:
        cumulative += shares[i]
        end = round(blocks * cumulative / weight_sum)
        lengths[i] = end - given
        given = end
    parts = []
    offset = 0
    for nblocks in lengths:
        start = min(offset * align, total)
        stop = min((offset + nblocks) * align, total)
        parts.append((start, stop - start))
        offset += nblocks
    return parts


def capped_shares(shares: list[float], cap: float) -> list[float]:
    """`shares` as fractions of 1, none above `cap` (water-filling: what a capped share loses
    goes to the others in proportion to theirs). Zero shares stay zero; a cap below an even
    split is raised to it. A pure function of its inputs, so every member derives the same parts.

    Why: a member's part of Δ is proportional to the bandwidth it advertises, and a reducer
    sees and answers for its whole part; without a cap one member claiming 1e9 Mbit/s would
    reduce (and could bend) nearly all of Δ."""
    positive = [i for i, s in enumerate(shares) if s > 0]
    if not positive or any(s < 0 or math.isnan(s) for s in shares):
        raise ValueError("need a positive share and no negative ones")
    cap = max(cap, 1.0 / len(positive))
    capped: set[int] = set()
    while True:
        free = [i for i in positive if i not in capped]
        budget = 1.0 - cap * len(capped)
        total = sum(shares[i] for i in free)
        over = [i for i in free if shares[i] / total * budget > cap]
        if not over:
            out = [0.0] * len(shares)
            for i in free:
                out[i] = shares[i] / total * budget
            for i in capped:
                out[i] = cap
            return out
        capped.update(over)
