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
terms need the sort: few in a sparse mean (whose caller passes its support only and says it is
mostly zero); a dense mean sorts every column. Three or four terms go through a sorting
network of element-wise min/max (about twice a plain sum's time), more through `torch.sort`.

Rows equal bit for bit are first merged into one, their weights summed (w1·x + w2·x =
(w1 + w2)·x): a moshpit group larger than the grid's side sends its one mean on to the next
hop from several members, each with a share of its weight, while a group elsewhere gets the
same mean from one member with the whole weight. Unmerged, the two groups added different
terms (½W·A + ½W·A + B against W·A + B) and their θ_g differed in the last bits, so an uneven
swarm re-synced every round. Weights are summed with `math.fsum` (correctly rounded, so in
any order, and ½W + ½W is W exactly). A mean of one distinct row is that row, bit for bit: a
peer alone in its group keeps its values, and a group whose members all brought the same mean
must hold the same bits (W·x/W is not always x in fp32).
"""

from __future__ import annotations

import math

import torch

# compare-exchange pairs that sort 3 and 4 values (optimal networks)
SORTING_NETWORKS = {
    3: ((0, 1), (1, 2), (0, 1)),
    4: ((0, 1), (2, 3), (0, 2), (1, 3), (1, 2)),
}
DENSE_SHARE = 4  # sort every coordinate once more than 1/DENSE_SHARE of them need it


def ordered_weighted_mean(
    rows: torch.Tensor, weights: list[float], out: torch.Tensor, mostly_zero: bool = False
) -> torch.Tensor:
    """out ← Σ_i weights[i] · rows[i] / Σ_i weights[i], the same bits for any order of the rows.

    `rows` is (contributors, values) fp32 and may be overwritten (with the products).
    `mostly_zero`: most columns have at most two non-zero values, so it pays to find the
    others and sort only those; otherwise every column is sorted.
    """
    n = rows.shape[0]
    if n != len(weights) or n < 1:
        raise ValueError(f"{n} rows need as many weights, and at least one")
    if out.shape != rows.shape[1:] or out.dtype != torch.float32 or rows.dtype != torch.float32:
        raise ValueError("rows (contributors, values) and out (values) must be fp32")
    if not all(w > 0 for w in weights):
        raise ValueError("weights must be positive")
    rows, weights = merge_equal_rows(rows, weights)
    n = rows.shape[0]
    if n == 1:  # the mean of one value is that value: w·x/w would not always give back x's bits
        return out.copy_(rows[0])
    rows.mul_(torch.tensor(weights, dtype=torch.float32).unsqueeze(1))
    if n <= 2:
        torch.sum(rows, dim=0, out=out)  # a + b = b + a
    elif not mostly_zero:
        out.copy_(_sum_ascending(rows))
    else:
        non_zero = rows[0].ne(0).to(torch.uint8)
        for row in rows[1:]:
            non_zero.add_(row.ne(0))
        many = non_zero >= 3
        count = int(many.sum())
        if count * DENSE_SHARE > many.numel():
            out.copy_(_sum_ascending(rows))
        else:
            torch.sum(rows, dim=0, out=out)  # exact in any order where at most two terms are non-zero
            if count:
                columns = many.nonzero().squeeze(1)
                out.index_copy_(0, columns, _sum_ascending(rows.index_select(1, columns)))
    return out.div_(sum_weights(weights))


def sum_weights(weights: list[float]) -> float:
    """The sum of the weights, correctly rounded: the same for any order or split of them."""
    return math.fsum(weights)


def merge_equal_rows(rows: torch.Tensor, weights: list[float]) -> tuple[torch.Tensor, list[float]]:
    """Rows equal bit for bit (-0.0 and 0.0 differ) kept once, with their weights summed.

    Returns `rows` itself when no two are equal, else a new tensor of the distinct rows, in
    the order of their first appearance.
    """
    n = rows.shape[0]
    if n < 2 or rows.shape[1] == 0:
        return rows, weights
    bits = rows.view(torch.int32)
    head = bits[:, :64]  # a cheap first look: different rows almost always differ here
    owner = list(range(n))
    for j in range(1, n):
        for i in range(j):
            if owner[i] == i and torch.equal(head[i], head[j]) and torch.equal(bits[i], bits[j]):
                owner[j] = i
                break
    keep = [i for i in range(n) if owner[i] == i]
    if len(keep) == n:
        return rows, weights
    merged = [sum_weights([w for j, w in enumerate(weights) if owner[j] == i]) for i in keep]
    return rows[keep], merged


def _sum_ascending(rows: torch.Tensor) -> torch.Tensor:
    """Each column's values added smallest first (rows is reordered in place)."""
    network = SORTING_NETWORKS.get(rows.shape[0])
    if network is None:
        rows = rows.sort(dim=0).values
    else:
        for i, j in network:
            low = torch.minimum(rows[i], rows[j])
            torch.maximum(rows[i], rows[j], out=rows[j])
            rows[i].copy_(low)
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total
