import math

import pytest
import torch

from dtnode.ops.outer_optimizer import NesterovOuterOptimizer
from dtnode.ops.partition import plan_parts
from dtnode.ops.quantization import (
    NonFiniteError,
    QuantizedBlocks,
    dequantize,
    quantize,
    quantize_with_feedback,
    relative_l2_error,
)


@pytest.mark.parametrize("block", [64, 256, 1024])
@pytest.mark.parametrize("numel", [1, 63, 1000, 100_003])
def test_round_trip_error_under_one_percent(block, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    y = dequantize(quantize(x, block))
    assert relative_l2_error(x, y) <= 0.01
    # each value is within half a quantization step (scale = block absmax / 127) of the original
    q = quantize(x, block)
    step = q.scales.repeat_interleave(block)[:numel]
    assert bool(((x - y).abs() <= step / 2 + 1e-6).all())
    assert y.shape == x.shape and y.dtype == torch.float32


def test_zeros_and_all_equal_blocks_are_exact():
    zeros = torch.zeros(1000)
    assert torch.equal(dequantize(quantize(zeros, 64)), zeros)
    equal = torch.full((300,), -2.5)
    assert torch.equal(dequantize(quantize(equal, 64)), equal)
    mixed = torch.cat([torch.zeros(64), torch.randn(64), torch.zeros(10)])
    y = dequantize(quantize(mixed, 64))
    assert torch.equal(y[:64], torch.zeros(64)) and torch.equal(y[128:], torch.zeros(10))


def test_empty_and_tiny_inputs():
    q = quantize(torch.empty(0), 64)
    assert q.codes.numel() == 0 and q.scales.numel() == 0
    assert dequantize(q).numel() == 0
    one = torch.tensor([3.0])
    assert torch.equal(dequantize(quantize(one, 64)), one)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_an_error(bad):
    x = torch.randn(500)
    x[321] = bad
    with pytest.raises(NonFiniteError):
        quantize(x, 64)


def test_codes_are_symmetric_and_scales_absmax():
    x = torch.randn(4096)
    q = quantize(x, 256)
    assert int(q.codes.min()) >= -127 and int(q.codes.max()) <= 127
    assert torch.allclose(q.scales, x.view(-1, 256).abs().amax(1) / 127)


def test_quantize_into_preallocated_buffers():
    x = torch.randn(1000)
    out = QuantizedBlocks(torch.empty(1000, dtype=torch.int8), torch.empty(16), 64)
    q = quantize(x, 64, out=out)
    assert q.codes.data_ptr() == out.codes.data_ptr()
    assert relative_l2_error(x, dequantize(q)) < 0.01


def test_outer_optimizer_matches_torch_nesterov_sgd():
    torch.manual_seed(0)
    theta = torch.randn(100)
    reference = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    ours = NesterovOuterOptimizer(100, lr=0.7, momentum=0.9)
    for _ in range(5):
        delta = torch.randn(100)
        reference.grad = delta.clone()
        sgd.step()
        ours.step(theta, delta)
    assert torch.allclose(theta, reference.detach(), atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_outer_steps_in_slices_are_bit_for_bit_torchs_sgd(momentum):
    """Members of a group must leave with bit-identical θ_g whatever the slice: the hand-written
    step (one slice-sized temporary) equals torch's SGD exactly, slices that do not divide the
    buffer (and vector-width tails) included, over several steps."""
    torch.manual_seed(3)
    n = 10_007
    theta = torch.randn(n)
    reference = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=momentum, nesterov=momentum > 0, foreach=False)
    sliced = [(NesterovOuterOptimizer(n, 0.7, momentum, step_slice=size), theta.clone()) for size in (n, 1000, 333, 7)]
    for _ in range(4):
        delta = torch.randn(n)
        reference.grad = delta.clone()
        sgd.step()
        for opt, values in sliced:
            opt.step(values, delta)
    for opt, values in sliced:
        assert torch.equal(values, reference.detach())
        if momentum:
            assert torch.equal(opt.momentum_buffer, sgd.state[reference]["momentum_buffer"])
    with pytest.raises(ValueError):
        NesterovOuterOptimizer(4, step_slice=0)


def test_outer_optimizer_keeps_its_momentum_in_the_buffer_it_checkpoints():
    """The momentum torch's SGD uses is the buffer a checkpoint saves and a re-sync overwrites:
    the same rule written out by hand (buf <- mu buf + d; theta <- theta - lr (d + mu buf))."""
    torch.manual_seed(1)
    theta, loaded = torch.randn(64), torch.randn(64)
    ours = NesterovOuterOptimizer(64, lr=0.5, momentum=0.8)
    ours.load_state_dict({"outer_momentum": loaded})
    expected_theta, buf = theta.clone(), loaded.clone()
    for _ in range(3):
        delta = torch.randn(64)
        buf = 0.8 * buf + delta
        expected_theta -= 0.5 * (delta + 0.8 * buf)
        ours.step(theta, delta)
    assert torch.allclose(ours.state_dict()["outer_momentum"], buf, atol=1e-6)
    assert torch.allclose(theta, expected_theta, atol=1e-5)
    plain = NesterovOuterOptimizer(4, lr=0.5, momentum=0.0)  # torch refuses Nesterov at mu = 0: plain SGD
    x = torch.ones(4)
    plain.step(x, torch.full((4,), 2.0))
    assert torch.equal(x, torch.zeros(4)) and plain.momentum_buffer.numel() == 0  # no buffer of zeros
    plain.load_state_dict({"outer_momentum": torch.ones(4)})  # an older checkpoint's zeros, or anything: ignored
    assert plain.momentum_buffer.numel() == 0
    ours.load_state_dict({"outer_momentum": torch.empty(0)})  # a file of a swarm without momentum: from zero
    assert torch.equal(ours.momentum_buffer, torch.zeros(64))
    with pytest.raises(ValueError):
        ours.step(torch.zeros(3), torch.zeros(3))


def test_outer_step_norm_bound_holds_every_step_and_is_exact_without_momentum():
    """What a running node judges a split-vote download by (`daemon/catchup/trust_radius.py`): a bound on how far
    each outer step moved θ_g, from two norms and no copy of θ_g."""
    torch.manual_seed(2)
    for momentum in (0.0, 0.9):
        opt = NesterovOuterOptimizer(256, lr=0.7, momentum=momentum)
        theta = torch.randn(256)
        for _ in range(5):
            before, delta = theta.clone(), torch.randn(256)
            opt.step(theta, delta)
            moved, bound = float((theta - before).norm()), float(opt.step_norm_bound(delta))
            assert moved <= bound * (1 + 1e-6)
            if momentum == 0.0:
                assert math.isclose(moved, bound, rel_tol=1e-5)


@pytest.mark.parametrize(
    "total,shares,align",
    [(1000, [1, 1, 1], 64), (10, [1, 0, 2], 4), (0, [1, 1], 8), (12345, [1, 3, 0, 2], 256), (7, [5], 4)],
)
def test_parts_cover_the_buffer_exactly(total, shares, align):
    parts = plan_parts(total, shares, align)
    assert len(parts) == len(shares)
    offset = 0
    for (start, length), share in zip(parts, shares):
        assert start == offset or length == 0
        assert start % align == 0 or length == 0
        if share == 0:
            assert length == 0
        offset = start + length if length else offset
    assert sum(length for _, length in parts) == total


def test_parts_follow_bandwidth():
    parts = plan_parts(1 << 20, [1, 3], align=256)
    assert math.isclose(parts[1][1] / parts[0][1], 3, rel_tol=0.01)


def test_error_feedback_keeps_the_accumulated_error_of_one_round():
    """Rounding to nearest is biased for a fixed input: without feedback the error of the
    running sum grows with every round; with feedback it stays that of one quantization."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    residual = torch.zeros_like(x)
    plain_sum, fed_sum = torch.zeros_like(x), torch.zeros_like(x)
    errors_plain, errors_fed = [], []
    for rounds in range(1, 51):
        plain_sum += dequantize(quantize(x, 64))
        fed_sum += dequantize(quantize_with_feedback(x, residual, 64))
        errors_plain.append(float((plain_sum - rounds * x).norm()))
        errors_fed.append(float((fed_sum - rounds * x).norm()))
    one_round = errors_plain[0]
    assert errors_plain[-1] > 40 * one_round  # grows linearly
    assert max(errors_fed) <= 1.01 * one_round  # bounded by a single round's error
    assert torch.equal(x, torch.randn(4096, generator=torch.Generator().manual_seed(3)))  # input untouched


def test_error_feedback_rejects_a_mismatched_residual():
    with pytest.raises(ValueError):
        quantize_with_feedback(torch.zeros(10), torch.zeros(11))


def test_fused_kernels_are_bit_identical_to_the_eager_path():
    from dtnode.ops import quantization

    cases = [
        torch.randn(n, generator=torch.Generator().manual_seed(n)) * 10 ** (n % 5) for n in (1, 255, 256, 300, 70_001)
    ]
    cases.append(torch.zeros(1024))
    cases.append(torch.full((1000,), 3.25))
    eager = [(quantize(x, 64), quantize(x, 256)) for x in cases]
    assert quantization.use_fused_kernels(True)
    try:
        for x, reference in zip(cases, eager):
            for q_ref, block in zip(reference, (64, 256)):
                q = quantize(x, block)
                assert torch.equal(q.codes, q_ref.codes) and torch.equal(q.scales, q_ref.scales)
                assert torch.equal(dequantize(q), dequantize(q_ref))
        with pytest.raises(NonFiniteError):
            quantize(torch.tensor([1.0, float("inf")] * 256), 256)
    finally:
        quantization.use_fused_kernels(False)
    assert not quantization.fused_kernels_active()


def test_trimmed_mean_keeps_every_coordinate_within_the_honest_range():
    from dtnode.ops.robust import trim_count, trimmed_mean

    honest = torch.randn(4, 10_000)
    hostile = honest[0:1] * 1e6
    result = trimmed_mean(torch.cat([honest, hostile]), trim_count(5, 0.2))
    low, high = honest.min(0).values, honest.max(0).values
    assert bool(((result >= low) & (result <= high)).all())
    # stated bound: no farther from the honest mean, per coordinate, than the farthest honest peer
    mean = honest.mean(0)
    assert bool(((result - mean).abs() <= (honest - mean).abs().max(0).values + 1e-6).all())
    assert float((torch.cat([honest, hostile]).mean(0) - mean).norm()) > 1e4 * float((result - mean).norm())
    assert trim_count(5, 0.2) == 1 and trim_count(2, 0.4) == 0 and trim_count(1, 0.0) == 0
    with pytest.raises(ValueError):
        trimmed_mean(torch.tensor([[1.0], [float("nan")]]), 0)


def test_no_reducer_takes_most_of_delta_whatever_bandwidth_it_claims():
    """Issue 31, finding 6: a member advertising 1e9 Mbit/s among three at 100 reduced 25M of
    25M elements. Now no part is over twice an even split (half of Δ among 4); honest
    differences in bandwidth still shape the parts below the cap, and the parts cover Δ."""
    from dtnode.ops.partition import capped_shares
    from dtnode.peers.plan import Member, make_plan

    members = [Member(f"peer{i}", "127.0.0.1:1", bandwidth=1e9 if i == 0 else 100.0) for i in range(4)]
    plan = make_plan("run", 0, 0, members, 25_000_000, 1024, 65536)
    lengths = [length for _, length in plan.parts]
    assert sum(lengths) == 25_000_000 and max(lengths) <= 25_000_000 // 2 + 1024, lengths
    assert capped_shares([1e9, 1, 1, 1], 0.5) == pytest.approx([0.5, 1 / 6, 1 / 6, 1 / 6])
    assert capped_shares([3, 1, 0], 0.5) == pytest.approx([0.5, 0.5, 0.0])  # two reducers: at most half each
    assert capped_shares([2, 1, 1, 1, 1, 1], 2 / 6) == pytest.approx([2 / 7, *[1 / 7] * 5])  # under the cap: as asked
    assert capped_shares([0, 5], 0.5) == pytest.approx([0.0, 1.0])  # one reducer takes it all
    three = make_plan("run", 0, 0, members[:3], 3 << 20, 1024, 65536)
    assert max(length for _, length in three.parts) <= (2 << 20) + 1024  # 2/3 of Δ


def test_a_trimmed_mean_of_three_or_four_trims_one_value_at_each_end():
    """Issue 31, finding 8: with --robust 0.2 a group of 4 trimmed nothing (floor(0.8) = 0),
    so one member's 1e6 moved the mean by 2.5e5. Now one value goes at each end from 3 up."""
    from dtnode.ops.robust import trim_count, trimmed_mean

    assert [trim_count(n, 0.2) for n in (1, 2, 3, 4, 5, 10, 11)] == [0, 0, 1, 1, 1, 2, 2]
    assert trim_count(4, 0.0) == 0  # robust aggregation off: a plain mean
    honest = torch.tensor([[1.0, -1.0], [1.2, -0.8], [0.8, -1.2]])
    result = trimmed_mean(torch.cat([honest, torch.tensor([[1e6, -1e6]])]), trim_count(4, 0.2))
    assert float(result.abs().max()) <= 1.2  # within the honest values, coordinate by coordinate


def test_the_median_aggregation_is_the_trimmed_mean_trimmed_as_far_as_it_goes():
    from dtnode.ops.robust import MEDIAN_FRACTION, trim_count, trimmed_mean

    assert [trim_count(n, MEDIAN_FRACTION) for n in (1, 2, 3, 4, 5, 8)] == [0, 0, 1, 1, 2, 3]
    values = torch.tensor([[1.0], [2.0], [1e6], [3.0], [-1e6]])
    assert float(trimmed_mean(values, trim_count(5, MEDIAN_FRACTION))) == 2.0  # two of five hostile: bounded
    four = torch.tensor([[1.0], [2.0], [4.0], [1e6]])
    assert float(trimmed_mean(four, trim_count(4, MEDIAN_FRACTION))) == 3.0  # the two middle values


def test_a_trimmed_mean_of_equal_values_is_that_value_bit_for_bit():
    """A later hop of an uneven grid under --aggregation trimmed-mean or median: a group whose
    members all brought the same mean must hold its bits, as a peer alone with it does, or the
    swarm's θ_g splits and re-syncs. w·x/w (and (x+x+x)/3) is not always x in fp32."""
    from dtnode.ops.robust import trimmed_mean

    x = torch.randn(100_000, generator=torch.Generator().manual_seed(3))
    weights = torch.tensor([1664.0, 1664.0, 3.0])
    kept = torch.stack([x, x])
    w = weights[:2, None]
    assert not torch.equal((kept * w).sum(0) / w.sum(0), x)  # the general formula loses bits here
    assert not torch.equal(torch.stack([x, x, x]).mean(0), x)
    for trim, rows in ((0, 2), (1, 3)):
        stacked = torch.stack([x] * rows)
        assert torch.equal(trimmed_mean(stacked, trim, weights=weights[:rows]), x)
        assert torch.equal(trimmed_mean(stacked, trim), x)
    # zeros of either sign: +0.0 from any mix, whatever the rows' order
    signed = torch.tensor([[-0.0], [0.0], [0.0]])
    for rows in (signed, signed.flip(0)):
        assert trimmed_mean(rows, 0, weights=torch.ones(3)).item() == 0.0
        assert not torch.signbit(trimmed_mean(rows, 0, weights=torch.ones(3))).any()
    # a coordinate whose kept values differ is still their weighted mean; an outlier is trimmed
    y = x.clone()
    y[:10] += 1.0
    mixed = trimmed_mean(torch.stack([x, y, x + 1e6, x - 1e6]), 1, weights=torch.tensor([1664.0, 1664.0, 3.0, 3.0]))
    assert torch.equal(mixed[10:], x[10:])
    torch.testing.assert_close(mixed[:10], x[:10] + 0.5)


def test_an_ordered_weighted_mean_has_the_same_bits_for_every_order_of_its_rows():
    """What lets two moshpit groups that reduce the same contributions agree bit for bit."""
    import itertools

    from dtnode.ops.ordered_mean import ordered_weighted_mean

    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(4, 50_000, generator=gen) * torch.tensor([[1.0], [1e-3], [1e3], [3.0]])
    rows[:, :20_000] *= (torch.rand(4, 20_000, generator=gen) < 0.3).float()  # sparse columns, some all zero
    rows[0, :10] = -0.0
    weights = [0.3, 1.7, 2.9, 1e4]
    for mostly_zero in (False, True):
        results = []
        for order in itertools.permutations(range(4)):
            out = torch.empty(50_000)
            ordered_weighted_mean(rows[list(order)].clone(), [weights[i] for i in order], out, mostly_zero)
            results.append(out)
        assert all(torch.equal(r, results[0]) for r in results[1:])
    for count in (3, 5):  # a sorting network, and torch.sort
        some = rows[:count] if count <= 4 else torch.cat([rows, rows[:1] * 0.5])
        sums = [
            ordered_weighted_mean(some[list(order)].clone(), [1.0] * count, torch.empty(50_000))
            for order in itertools.permutations(range(count))
        ]
        assert all(torch.equal(s, sums[0]) for s in sums[1:])
    exact = (rows.double() * torch.tensor(weights, dtype=torch.float64).unsqueeze(1)).sum(0) / sum(weights)
    torch.testing.assert_close(results[0].double(), exact, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        ordered_weighted_mean(rows.clone(), [1.0, 0.0, 1.0, 1.0], out=torch.empty(50_000))


def test_one_mean_sent_in_shares_by_several_members_adds_as_if_sent_once():
    """½W·A + ½W·A + B and W·A + B: two groups of the next moshpit hop that got a mean from two
    members or from one must add the same terms. Rows equal bit for bit are merged, their
    weights summed correctly rounded; rows that differ in one bit (0.0 against -0.0) are not."""
    import itertools

    from dtnode.ops.ordered_mean import merge_equal_rows, ordered_weighted_mean, sum_weights

    gen = torch.Generator().manual_seed(3)
    a, b, c = torch.randn(3, 10_000, generator=gen)
    once = torch.empty(10_000)
    ordered_weighted_mean(torch.stack([a, b, c]), [3.0, 0.7, 1.9], out=once)
    for order in itertools.permutations(range(4)):
        rows = torch.stack([a, a, b, c])[list(order)]
        split = torch.empty(10_000)
        ordered_weighted_mean(rows.clone(), [[1.5, 1.5, 0.7, 1.9][i] for i in order], out=split)
        assert torch.equal(split, once)
    # a group whose members all brought one mean holds it as a peer alone with it does
    alone = torch.empty(10_000)
    assert torch.equal(ordered_weighted_mean(torch.stack([a, a]), [1664.0, 1664.0], out=alone), a)
    merged, weights = merge_equal_rows(torch.stack([a, b, a, a]), [0.1, 2.0, 0.2, 0.3])
    assert torch.equal(merged, torch.stack([a, b])) and weights == [sum_weights([0.1, 0.2, 0.3]), 2.0]
    zero, negative_zero = torch.zeros(4), torch.zeros(4)
    negative_zero[0] = -0.0
    distinct = torch.stack([zero, negative_zero])
    assert merge_equal_rows(distinct, [1.0, 1.0])[0] is distinct
    assert sum_weights([1e16, 1.0, -1e16]) == 1.0  # correctly rounded, whatever the order


def test_a_weighted_trimmed_mean_has_the_same_bits_for_every_order_of_its_rows():
    """Ties in value with different weights too: which one is trimmed, and the order of the sums,
    must not depend on which member reduced or who arrived first."""
    import itertools

    from dtnode.ops.robust import trimmed_mean

    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(5, 20_000, generator=gen)
    rows[1, :5000] = rows[0, :5000]  # equal values, different weights
    rows[3, 5000:9000] = rows[2, 5000:9000]
    weights = torch.tensor([1.0, 3.0, 0.7, 2.5, 1.1], dtype=torch.float64)
    results = [
        trimmed_mean(rows[list(order)].clone(), 1, weights=weights[list(order)])
        for order in itertools.permutations(range(5))
    ]
    assert all(torch.equal(r, results[0]) for r in results[1:])
