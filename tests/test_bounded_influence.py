"""Issue 31, findings 4, 5 and 8: one member's weight, total weight and θ_g re-sync are bounded.

Real gRPC servers on loopback (tests/allreduce_harness.py); the attacker is a member running
the project's own butterfly with one input changed, as a hostile build would.
"""

import asyncio
from dataclasses import replace

import grpc
import pytest
import torch
from allreduce_harness import allreduce, start_peers, stop_peers

from dtnode.ops.robust import CLIP_REACH, clip_to_median, lower_median, trim_count, trimmed_mean
from dtnode.peers.butterfly import butterfly_allreduce
from dtnode.peers.part_result import DriftBound
from dtnode.peers.plan import FP32, INT8, WEIGHT_SPREAD, Member, capped_weights, make_plan
from dtnode.peers.wire import RefusalReason, chunk_message
from dtnode.proto import averaging_pb2_grpc as pb_grpc


def exact_mean(values, weights):
    return sum(w * v for w, v in zip(weights, values)) / sum(weights)


def _plan(members, numel, **kw):
    return make_plan("test-run", 0, 0, members, numel, 64, 4096, FP32, **kw)


def test_announced_weights_are_capped_at_a_spread_of_the_median_and_bind_the_plan():
    assert capped_weights([100.0, 100.0, 100.0, 1e9]) == (100.0, 100.0, 100.0, WEIGHT_SPREAD * 100)
    assert capped_weights([100.0, 1e12]) == (100.0, WEIGHT_SPREAD * 100)  # a pair: the smaller bounds the other
    assert capped_weights([100.0, 800.0, 50.0]) == (100.0, 800.0, 50.0)  # an 8x bigger batch counts in full
    assert capped_weights([0.0, 0.0]) == ()  # nobody announced: no bounds (plans built outside matchmaking)
    # issue 56, finding 5: one member announcing 0 switched every cap of its group off; it counts 0
    assert capped_weights([100.0, 0.0, 1e12]) == (100.0, 0.0, WEIGHT_SPREAD * 100)
    members = [Member(f"p{i}", "x:1", weight=100.0) for i in range(3)]
    plan = _plan(members, 1024)
    other = _plan([*members[:2], replace(members[2], weight=101.0)], 1024)
    assert plan.group_id != other.group_id  # members that read different registrations never mix chunks
    assert plan.expected_total_weight(["p0", "p2"]) == 200.0 and plan.announced_weight("p1") == (100.0, 100.0)


def test_a_weighted_trimmed_mean_respects_weights_and_stays_within_the_honest_range():
    honest = torch.randn(4, 5000)
    hostile = honest[:1] * 1e6
    stacked = torch.cat([honest, hostile])
    weights = torch.tensor([1.0, 1.0, 1.0, 5.0, 8.0])
    result = trimmed_mean(stacked, trim_count(5, 0.2), weights=weights)
    low, high = honest.min(0).values, honest.max(0).values
    assert bool(((result >= low - 1e-6) & (result <= high + 1e-6)).all())
    # with nothing trimmed it is the plain weighted mean
    assert torch.allclose(
        trimmed_mean(honest, 0, weights=weights[:4]), exact_mean(list(honest), weights[:4].tolist()), atol=1e-6
    )
    with pytest.raises(ValueError):
        trimmed_mean(honest, 1, weights=torch.tensor([1.0, 0.0, 1.0, 1.0]))


def test_a_stream_claiming_more_than_its_registration_is_refused_and_a_big_registration_is_capped():
    """Finding 5: weights were self-reported up to 1e12, so one member's Δ was the mean. Now a
    stream may claim no more than its signed registration announced (refused, counted as
    bad_weight), and what a registration announces counts WEIGHT_SPREAD x the median at most."""

    async def main():
        peers = await start_peers(4)
        numel = 16384
        values = [torch.randn(numel) for _ in peers]
        values[0] = values[0] * 1.5  # the attacker's Δ: off, but within the plain mean's length bound
        announced = [1e9, 100.0, 100.0, 100.0]  # the attacker also announced a huge token count
        members = [replace(p.member, weight=w) for p, w in zip(peers, announced)]
        plan = _plan(members, numel)
        outs = [torch.empty(numel) for _ in peers]
        claimed = [1e12, 100.0, 100.0, 100.0]  # ... and claims still more in its streams
        try:
            reports = await asyncio.gather(
                *(
                    butterfly_allreduce(plan, p.member.peer_id, v, w, o, p.registry, p.channels, timeout=5.0)
                    for p, v, w, o in zip(peers, values, claimed, outs)
                )
            )
        finally:
            await stop_peers(peers)
        assert sum(p.service.refused[RefusalReason.BAD_WEIGHT] for p in peers[1:]) == 3
        honest_mean = exact_mean(values[1:], [100.0] * 3)
        capped = exact_mean(values, [WEIGHT_SPREAD * 100, 100.0, 100.0, 100.0])  # its own part: weight capped
        for out, report in zip(outs[1:], reports[1:]):
            assert not report.failed_parts
            for part, (offset, length) in enumerate(plan.parts):
                expected = capped if plan.members[part].peer_id == "peer00" else honest_mean
                assert torch.allclose(out[offset : offset + length], expected[offset : offset + length], atol=1e-4)
        # before: the 1e12 claim made every part ~values[0]; now its pull is bounded everywhere
        assert float((outs[1] - honest_mean).norm()) < 0.5 * float((values[0] - honest_mean).norm())

    asyncio.run(main())


class _InflatingReducer(pb_grpc.AveragingServicer):
    """A reducer that answers its part with the honest mean but claims a total weight of 1e12."""

    def __init__(self, plan, part: int, honest_values: torch.Tensor):
        self.plan, self.part, self.values = plan, part, honest_values

    async def Reduce(self, request_iterator, context):
        async for chunk in request_iterator:
            if chunk.last:
                break
        offset, length = self.plan.parts[self.part]
        answer = chunk_message(self.plan, self.part, "peer-liar", 1.0, 0, self.values[offset : offset + length].clone())
        answer.last = True
        answer.included.extend(sorted(self.plan.member_ids))
        answer.total_weight = 1e12  # within MAX_WEIGHT x members; not the sum of its senders' weights
        yield answer


def test_a_reducer_whose_total_weight_is_not_the_sum_of_its_senders_is_refused():
    """Finding 5: a reducer's total weight was only range-checked, so 1e12 passed and, carried
    into the next moshpit hop, outweighed everyone. Now it must equal the plan's sum."""

    async def main():
        (honest,) = await start_peers(1)
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        members = [replace(honest.member, weight=100.0), Member("peer-liar", f"127.0.0.1:{port}", weight=100.0)]
        plan = _plan(members, 8192)
        values, out = torch.randn(8192), torch.empty(8192)
        pb_grpc.add_AveragingServicer_to_server(_InflatingReducer(plan, plan.index_of("peer-liar"), values), server)
        await server.start()
        try:
            report = await butterfly_allreduce(
                plan, honest.member.peer_id, values, 100.0, out, honest.registry, honest.channels, timeout=5.0
            )
        finally:
            await server.stop(None)
            await stop_peers([honest])
        assert [p.reducer for p in report.failed_parts] == ["peer-liar"]
        assert "total weight" in report.failed_parts[0].error

    asyncio.run(main())


def _quarter(theta: torch.Tensor) -> DriftBound:
    """A re-sync may move θ by a quarter of its norm here (a node's bound is its outer steps')."""
    return DriftBound(0.25 * float(theta.norm()), 0.0, theta.numel())


def test_a_theta_resync_result_that_drifts_too_far_is_refused():
    """Finding 4: a re-sync of θ_g was a plain mean with self-reported weights, so one member
    replaced θ_g for its group. Now its weights are equal and fixed by the plan (a 1e12 claim is
    refused), and a result that moves a member's θ_g by more than the drift limit is refused."""

    async def main():
        peers = await start_peers(3)
        numel = 16384
        theta = torch.randn(numel)
        values = [theta + 1e-3 * torch.randn(numel) for _ in peers]
        values[0] = theta * 50  # the attacker's θ_g
        plan = _plan([replace(p.member, weight=1.0) for p in peers], numel, clip_lengths=False)  # a re-sync's
        outs = [torch.empty(numel) for _ in peers]
        try:
            huge = await asyncio.gather(
                *(
                    butterfly_allreduce(
                        plan, p.member.peer_id, v, w, o, p.registry, p.channels, timeout=5.0, drift=_quarter(v)
                    )
                    for p, v, w, o in zip(peers, values, [1e12, 1.0, 1.0], outs)
                )
            )
            honest_mean = (values[1] + values[2]) / 2
            for out in outs[1:]:
                for offset, length in plan.parts[1:]:  # the honest reducers' parts: the 1e12 stream refused
                    assert torch.allclose(out[offset : offset + length], honest_mean[offset : offset + length])
            equal = await asyncio.gather(  # weight 1 like everyone: the mean moves θ_g 16x: refused
                *(
                    butterfly_allreduce(
                        replace(plan, round=1),
                        p.member.peer_id,
                        v,
                        1.0,
                        o,
                        p.registry,
                        p.channels,
                        timeout=5.0,
                        drift=_quarter(v),
                    )
                    for p, v, o in zip(peers, values, outs)
                )
            )
        finally:
            await stop_peers(peers)
        assert all(r.failed_parts for r in huge[1:])  # the attacker's own part: refused as drifted
        for honest, report, out in zip(values[1:], equal[1:], outs[1:]):
            # every part that includes the attacker's θ_g drifted: refused, own θ_g kept there
            assert {p.reducer for p in report.failed_parts} >= {"peer00"}
            assert float((out - honest).norm()) <= 0.25 * float(honest.norm())

    asyncio.run(main())


async def _resync(peers: list, values: list[torch.Tensor], drift: DriftBound) -> tuple[list, list[torch.Tensor]]:
    """A θ_g re-sync of `values` among `peers` (weight 1 each), every member holding `drift`;
    (their reports, their results). Stops the peers."""
    numel = values[0].numel()
    plan = _plan([replace(p.member, weight=1.0) for p in peers], numel, clip_lengths=False)  # as group_reduce's
    outs = [torch.empty(numel) for _ in peers]
    try:
        reports = await asyncio.gather(
            *(
                butterfly_allreduce(plan, p.member.peer_id, v, 1.0, o, p.registry, p.channels, 5.0, drift=drift)
                for p, v, o in zip(peers, values, outs)
            )
        )
    finally:
        await stop_peers(peers)
    return list(reports), outs


def test_a_pair_partner_cannot_move_theta_by_a_resync_beyond_a_few_outer_steps():
    """Issue 56, finding 4: a re-sync result was bounded by 4x the norm of θ itself, and a group of
    two trims nothing, so a member paired with a victim that sent 2T - θ set the victim's θ_g to
    any T within about 4‖θ‖ of it, -θ included (T = -2.5θ here, 3.5‖θ‖ away). The bound is now
    a few of the node's own recent outer steps (`UpdateBounds.resync_bound`): refused, θ_g kept."""

    async def main():
        peers = await start_peers(2)
        numel = 16384
        theta = torch.randn(numel)
        target = -2.5 * theta
        values = [2 * target - theta, theta.clone()]  # the attacker's, then the victim's
        step = 0.01 * float(theta.norm())  # an outer step of the victim's recent ones
        bound = DriftBound(4 * 2 * step, 0.0, numel)
        assert float((target - theta).norm()) <= 4 * float(theta.norm())  # within the old bound
        reports, outs = await _resync(peers, values, bound)
        assert len(reports[1].failed_parts) == 2  # both parts refused by the victim
        assert torch.equal(outs[1], theta)

    asyncio.run(main())


def test_a_member_announcing_a_zero_weight_has_its_streams_refused_and_caps_stay_on():
    """Issue 56, finding 5: a registration announcing weight 0 switched every weight cap of its
    group off, and its streams could then claim 1e12 tokens. A 0 among announced weights now
    counts 0: its streams are refused, the others are capped as before."""

    async def main():
        peers = await start_peers(3)
        numel = 4096
        members = [replace(p.member, weight=w) for p, w in zip(peers, [0.0, 100.0, 100.0])]
        plan = _plan(members, numel)
        assert plan.weight_caps == (0.0, 100.0, 100.0)
        values = [torch.full((numel,), 1000.0), torch.ones(numel), torch.ones(numel)]
        outs = [torch.empty(numel) for _ in peers]
        try:
            await asyncio.gather(
                *(
                    butterfly_allreduce(plan, p.member.peer_id, v, w, o, p.registry, p.channels, timeout=5.0)
                    for p, v, w, o in zip(peers, values, [1e12, 100.0, 100.0], outs)
                )
            )
        finally:
            await stop_peers(peers)
        for out in outs[1:]:
            for offset, length in plan.parts[1:]:  # the honest reducers' parts: the attacker's stream refused
                assert torch.equal(out[offset : offset + length], torch.ones(length))

    asyncio.run(main())


def test_a_member_of_a_group_of_one_theta_moves_the_others_by_its_share_of_the_bound_only():
    """Issue 56: a member that asked a group of peers holding one θ_g for a re-sync, and sent
    values of its own, moved every one of them by the whole drift bound (4 outer steps), round
    after round. A mean moves by 1/members of any one member's pull, so where the others announced
    this node's own θ_g hash the bound is shared (`DriftBound.shared`): a pull half the bound,
    within it before, is now refused, and each honest member keeps its θ_g."""

    async def main():
        peers = await start_peers(5)
        numel = 16384
        theta = torch.randn(numel)
        bound = DriftBound(0.05 * float(theta.norm()), 0.0, numel)
        pull = torch.randn(numel)
        pull *= 5 * 0.5 * bound.theta / float(pull.norm())  # moves the mean by half the bound
        values = [theta + pull, *(theta.clone() for _ in peers[1:])]
        shared = bound.shared(0, len(peers))  # the others announced this node's hash
        assert shared.theta == pytest.approx(bound.theta / 5)
        reports, outs = await _resync(peers, values, shared)
        for report, out in zip(reports[1:], outs[1:]):
            assert report.failed_parts and float((out - theta).norm()) <= 2 * shared.theta

    asyncio.run(main())


def test_the_plain_mean_holds_each_contribution_to_twice_the_lower_median_length_in_any_order():
    """Issue 56: the plain mean was bounded only by each node on its own, after the mean, by its
    own factor: one member's 1000x Δ set the direction of every mean, and the honest θ_g split. Each
    contribution to a chunk is now held to CLIP_REACH x the lower median of the chunk's lengths."""
    honest = torch.randn(3, 4096)
    rows = torch.cat([honest, -1000 * honest[:1]])
    lengths = [float(row.norm()) for row in rows]
    clipped = rows.clone()
    assert clip_to_median(clipped) == 1
    assert torch.equal(clipped[:3], honest)  # honest rows of similar length: untouched
    assert float(clipped[3].norm()) == pytest.approx(CLIP_REACH * lower_median(lengths), rel=1e-5)
    order = [2, 3, 0, 1]  # the rows' order decides nothing
    permuted = rows[order].clone()
    clip_to_median(permuted)
    assert torch.equal(permuted, clipped[order])
    # a pair: the shorter bounds the longer, both ways
    pair = torch.stack([honest[0], 1000 * honest[1]])
    clip_to_median(pair)
    assert float(pair[1].norm()) == pytest.approx(CLIP_REACH * float(honest[0].norm()), rel=1e-5)
    # a peer that trained nothing neither counts nor is scaled
    with_zero = torch.cat([honest[:2], torch.zeros(1, 4096)])
    assert clip_to_median(with_zero) == 0 and torch.equal(with_zero[:2], honest[:2])


@pytest.mark.parametrize("codec", [INT8, FP32])
def test_one_member_s_outsized_delta_moves_every_member_s_mean_alike_and_within_the_bound(codec):
    """Issue 56: in the plain mean, a member sending a 1000x Δ made the group's mean its own, and
    each honest node then scaled that mean by its own factor, splitting their θ_g. Every reducer
    now clips the outsized contribution: all honest members receive one result (bit for bit), no
    farther from the honest mean than the attacker's clipped share, real gRPC on loopback."""

    async def main():
        peers = await start_peers(4)
        numel = 16384
        common = torch.randn(numel)
        values = [common + 0.3 * torch.randn(numel) for _ in peers]
        values[0] = -1000 * values[0]
        members = [replace(p.member, weight=100.0) for p in peers]
        try:
            outs, reports = await allreduce(peers, values, [100.0] * 4, codec=codec, members=members, timeout=5.0)
        finally:
            await stop_peers(peers)
        assert not any(r.failed_parts for r in reports)
        assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[3])
        honest_mean = exact_mean(values[1:], [1.0] * 3)
        typical = float(values[1].norm())
        # the attacker counts a quarter, at most CLIP_REACH x an honest length (x a little, for the
        # chunk medians and int8); before, the result was 250x an honest Δ away
        assert float((outs[1] - honest_mean).norm()) <= 1.1 * (CLIP_REACH + 1) * typical / 4

    asyncio.run(main())
