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
