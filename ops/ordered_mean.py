"""A weighted mean whose bits depend only on the set of contributions, not on their order.

fp32 addition is not associative: a reducer that adds a, b, c as they arrive gets (a+b)+c or
(a+c)+b, which can differ in the last bit. Inside one group that does not matter (every member
receives the one reducer's result), but moshpit can have two groups compute the mean of the
same contributions: a peer alone in a hop stands in two classes of the next hop, and each of
those groups reduces the same values with different reducers and arrival orders. Their results
then differ by an ulp here and there, the members end with different θ_g hashes, and with no
scheduled re-sync (sparse mode) they stay apart.

Here each coordinate's weighted values are added in ascending order of value, so the result
is a function of the multiset of (value x weight) per coordinate, and the divisor is the sum
of the weights in ascending order. A coordinate with at most two non-zero terms is exact in
any order (x + 0 = x, and a + b = b + a), so only coordinates with three or more non-zero
terms are sorted: few in a sparse mean, all of them in a dense one.
"""

from __future__ import annotations

import torch


def ordered_weighted_mean(rows: torch.Tensor, weights: list[float], out: torch.Tensor) -> torch.Tensor:
    """out ← Σ_i weights[i] · rows[i] / Σ_i weights[i], the same bits for any order of the rows.

    `rows` is (contributors, values) fp32 and is overwritten (it holds the products after).
    """
    n = rows.shape[0]
    if n != len(weights) or n < 1:
        raise ValueError(f"{n} rows need as many weights, and at least one")
    if out.shape != rows.shape[1:] or out.dtype != torch.float32 or rows.dtype != torch.float32:
        raise ValueError("rows (contributors, values) and out (values) must be fp32")
    if not all(w > 0 for w in weights):
        raise ValueError("weights must be positive")
    rows.mul_(torch.tensor(weights, dtype=torch.float32).unsqueeze(1))
    torch.sum(rows, dim=0, out=out)  # exact in any order where at most two terms are non-zero
    if n >= 3:
        many = ((rows != 0).sum(dim=0) >= 3).nonzero().squeeze(1)
        if many.numel():
            ordered = rows.index_select(1, many).sort(dim=0).values
            total = ordered[0].clone()
            for row in ordered[1:]:
                total.add_(row)
            out.index_copy_(0, many, total)
    return out.div_(sum(sorted(weights)))
