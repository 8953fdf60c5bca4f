"""Δ kept as int8 codes where θ_g is in host memory: 1 byte per parameter, not 4, from the
moment Δ is taken through the all-reduce to the outer step (ops/coded.py)."""

import asyncio
import math
import threading

import pytest
import torch
from allreduce_harness import start_peers, stop_peers

from dtnode.daemon.training.coded_replica import CodedReplica
from dtnode.daemon.training.outer_replica import Replica
from dtnode.daemon.training.schedule import LearningRateSchedule
from dtnode.daemon.training.trainer import Trainer
from dtnode.daemon.training.update_bounds import MAX_ALLOWANCE, OUTER_REACH
from dtnode.daemon.workload.data import DataSources, DataStream, MarkovLanguage
from dtnode.daemon.workload.model import build_model
from dtnode.ops.coded import CodedDelta, SpanEncoder
from dtnode.ops.outer_optimizer import NesterovOuterOptimizer
from dtnode.ops.quantization import dequantize, quantize, quantize_with_feedback
from dtnode.peers.butterfly import butterfly_allreduce
from dtnode.peers.part_codec import Feedback
from dtnode.peers.plan import FP32, INT8, Member, make_plan


def _spans(n: int, seed: int) -> list[slice]:
    """Consecutive spans of uneven lengths (1 value, under a block, several blocks) covering [0, n)."""
    gen = torch.Generator().manual_seed(seed)
    spans, at = [], 0
    while at < n:
        length = int(torch.randint(1, 700, (1,), generator=gen))
        spans.append(slice(at, min(at + length, n)))
        at += length
    return spans


@pytest.mark.parametrize("feedback", [False, True])
def test_coding_span_by_span_gives_the_codes_of_the_whole_buffer(feedback):
    """A sharded host codes Δ one parameter at a time, and parameters do not end on block
    boundaries: the codes (and the feedback's residual) are those of coding the buffer whole."""
    values = torch.randn(10_007, generator=torch.Generator().manual_seed(1))
    whole_residual = torch.randn(values.numel()) * 1e-3
    residual = whole_residual.clone()
    coded = CodedDelta(values.numel(), 256)
    encoder = SpanEncoder(coded, residual if feedback else None)
    for span in _spans(values.numel(), 2):
        encoder.add(values[span])
    encoder.finish()
    expected = quantize_with_feedback(values, whole_residual, 256) if feedback else quantize(values, 256)
    assert torch.equal(coded.codes, expected.codes) and torch.equal(coded.scales, expected.scales)
    if feedback:
        assert torch.equal(residual, whole_residual)


def test_a_coded_buffer_is_sliced_on_block_boundaries_only_and_reads_back_what_was_stored():
    coded = CodedDelta(1000, 64)
    values = torch.randn(1000)
    coded.whole().store_values(values)
    assert torch.equal(coded.whole().decoded(), dequantize(quantize(values, 64)))
    assert torch.allclose(coded.norm(), torch.linalg.vector_norm(coded.whole().decoded()))
    assert coded[960:1000].numel() == 40  # the last, short block
    for bad in (slice(1, 64), slice(0, 65), slice(0, 1000, 2)):
        with pytest.raises(ValueError):
            coded[bad]
    part = coded[64:128]
    part.store(quantize(torch.ones(64), 64))
    assert torch.equal(coded[64:128].decoded(), torch.ones(64))
    with pytest.raises(ValueError, match="does not match"):
        part.store(quantize(torch.ones(64), 32))
    with pytest.raises(ValueError, match="residual"):
        SpanEncoder(coded, torch.zeros(999))


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_an_outer_step_along_a_coded_mean_is_the_step_along_its_decoded_values(momentum):
    """Bit for bit, with slices that are not a multiple of the block (the step rounds them)."""
    n = 5000
    coded = CodedDelta(n, 96)
    coded.whole().store_values(torch.randn(n) * 1e-2)
    dense = coded.whole().decoded()
    theta = torch.randn(n)
    a = NesterovOuterOptimizer(n, 0.7, momentum, step_slice=1000)
    b = NesterovOuterOptimizer(n, 0.7, momentum, step_slice=1000)
    ta, tb = theta.clone(), theta.clone()
    for _ in range(3):
        a.step(ta, coded)
        b.step(tb, dense)
    assert torch.equal(ta, tb) and torch.equal(a.momentum_buffer, b.momentum_buffer)
    assert torch.allclose(a.step_norm_bound(coded), b.step_norm_bound(dense))


@pytest.mark.parametrize("momentum", [0.9, 0.0])
@pytest.mark.parametrize("coded", [False, True], ids=["fp32", "coded"])
def test_outer_steps_over_uneven_ranges_are_the_whole_step_bit_for_bit(momentum, coded):
    """A landing steps θ_g a span (a parameter) at a time; spans cut blocks anywhere."""
    n = 5000
    values = torch.randn(n, generator=torch.Generator().manual_seed(7)) * 1e-2
    delta: torch.Tensor | CodedDelta = _coded(values, 96) if coded else values
    theta = torch.randn(n)
    whole, ranged = (NesterovOuterOptimizer(n, 0.7, momentum, step_slice=1000) for _ in range(2))
    ta, tb = theta.clone(), theta.clone()
    for _ in range(2):
        whole.step(ta, delta)
        for span in _spans(n, 8):
            ranged.step_range(tb, delta, span.start, span.stop)
    assert torch.equal(ta, tb) and torch.equal(whole.momentum_buffer, ranged.momentum_buffer)
    with pytest.raises(ValueError, match="range"):
        ranged.step_range(tb, delta, 10, n + 1)


def _replica(coded: bool) -> Replica:
    model, _ = build_model("tiny", seed=1)
    language = MarkovLanguage(seed=2)
    stream = DataStream(DataSources(language, language), "run", "a", 4, 16)
    trainer = Trainer(
        model, stream, torch.device("cpu"), schedule=LearningRateSchedule(1e-3), weight_decay=0.1, grad_clip=1.0
    )
    return CodedReplica(trainer, 0.7, 0.9, 256) if coded else Replica(trainer, 0.7, 0.9)


def test_a_coded_replica_holds_delta_in_one_byte_per_parameter_and_steps_as_a_dense_one_does():
    """No model-sized fp32 Δ: θ_g and the momentum are the fp32 buffers; Δ is int8 codes. With
    error feedback, what the codes lost is owed in the residual, and the outer step of the coded
    Δ is the dense replica's step of the same values. A replica on a GPU stages Δ in fp32."""
    r, dense = _replica(True), _replica(False)
    assert r.coded and not dense.coded
    assert _fp32_model_sized(r) == {id(r.theta_g), id(r.outer.momentum_buffer)}
    assert isinstance(r.delta_cpu, CodedDelta) and r.delta_cpu.codes.dtype == torch.int8
    r.feedback = torch.zeros(r.numel)
    shift = torch.randn(r.numel, generator=torch.Generator().manual_seed(3)) * 1e-2
    for replica in (r, dense):
        replica.trainer.parameters_flat.add_(shift)
    delta = r.pseudo_gradient()
    assert delta is r.delta_cpu
    decoded = delta.whole().decoded()
    assert torch.allclose(decoded + r.feedback, -shift, atol=1e-7)  # nothing lost: the residual owes it
    dense.pseudo_gradient()
    dense.apply_outer_step(decoded.clone())
    r.apply_outer_step(delta)
    assert torch.equal(r.theta_g, dense.theta_g) and torch.equal(r.trainer.parameters_flat, r.theta_g)


def _fp32_model_sized(r: Replica) -> set[int]:
    return {
        id(v)
        for v in (*vars(r).values(), *vars(r.outer).values())
        if isinstance(v, torch.Tensor) and v.numel() >= r.numel
    }


def test_an_overlapped_coded_replica_lands_as_a_dense_one_and_theta_l_keeps_what_the_code_lost():
    """--overlap with Δ coded: the Δ in flight is codes too (no fp32 buffer for it or for the
    landing), θ_g lands bit for bit as a dense replica's, and θ_l differs from the dense one's
    by the rounding of the Δ in flight, which the next Δ then carries. A failed average with a
    re-sync moves θ_l by θ_g's change; a non-finite loss's reset leaves θ_g − the Δ in flight."""
    r, dense = _replica(True), _replica(False)
    gen = torch.Generator().manual_seed(6)
    shifts = [torch.randn(r.numel, generator=gen) * 1e-2 for _ in range(2)]
    for replica in (r, dense):
        replica.trainer.parameters_flat.add_(shifts[0])
    staged, exact = r.stage_delta(), dense.stage_delta()
    assert staged is r.delta_cpu and r.has_in_flight
    in_flight = staged.whole().decoded()
    assert isinstance(exact, torch.Tensor) and torch.allclose(exact, -shifts[0], atol=1e-6)
    for replica in (r, dense):  # the next round's steps while the Δ is averaged
        replica.trainer.parameters_flat.add_(shifts[1])
    mean = _coded(torch.randn(r.numel, generator=gen) * 1e-2, 256)
    r.land(mean, None)
    dense.land(mean.whole().decoded(), None)
    assert torch.equal(r.theta_g, dense.theta_g) and r.outer_step == dense.outer_step == 1
    rounding = in_flight - exact
    torch.testing.assert_close(r.trainer.parameters_flat, dense.trainer.parameters_flat + rounding, rtol=0, atol=1e-6)
    assert _fp32_model_sized(r) == {id(r.theta_g), id(r.outer.momentum_buffer)}
    consensus = torch.cat([r.theta_g + 0.5, r.outer.momentum_buffer])
    for replica in (r, dense):
        replica.stage_delta()
        replica.land(None, consensus.clone())  # the average failed, a re-sync came
    assert torch.equal(r.theta_g, dense.theta_g) and r.outer_step == 1
    torch.testing.assert_close(r.trainer.parameters_flat, dense.trainer.parameters_flat + rounding, rtol=0, atol=1e-6)
    r.stage_delta()
    r.reset_local()
    torch.testing.assert_close(r.trainer.parameters_flat, r.theta_g - r.delta_cpu.whole().decoded(), rtol=0, atol=1e-7)


def test_a_non_finite_pseudo_gradient_fails_the_round_as_a_non_finite_loss_does():
    r = _replica(True)
    r.trainer.parameters_flat[5] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite"):
        r.pseudo_gradient()


def _coded(values: torch.Tensor, block: int) -> CodedDelta:
    coded = CodedDelta(values.numel(), block)
    coded.whole().store_values(values)
    return coded


@pytest.mark.parametrize("hop", [0, 1])
def test_coded_members_send_their_codes_and_store_the_mean_as_it_came(hop):
    """Three members (uneven bandwidths, one in client mode) average coded Δs in place: every
    member ends with the same codes, the weighted mean of what they held within int8's error;
    a member that holds its Δ in fp32 beside them gets the same mean."""
    n, block = 3 * 5000 + 7, 256

    async def main(inputs: list[torch.Tensor | CodedDelta]):
        peers = await start_peers(3, bandwidths=[1.0, 2.5, 1.0], client_mode=(2,))
        plan = make_plan("test-run", 0, hop, [p.member for p in peers], n, block, 2048, INT8)
        try:
            reports = await asyncio.gather(
                *(
                    butterfly_allreduce(plan, p.member.peer_id, v, w, v, p.registry, p.channels, timeout=10.0)
                    for p, v, w in zip(peers, inputs, [0.5, 1.0, 2.0])
                )
            )
        finally:
            await stop_peers(peers)
        assert all(not r.failed_parts for r in reports)

    gen = torch.Generator().manual_seed(4)
    values = [torch.randn(n, generator=gen) for _ in range(3)]
    coded = [_coded(v, block) for v in values]
    held = [c.whole().decoded() for c in coded]
    asyncio.run(main(list(coded)))
    for c in coded[1:]:
        assert torch.equal(c.codes, coded[0].codes) and torch.equal(c.scales, coded[0].scales)
    expected = (0.5 * held[0] + held[1] + 2.0 * held[2]) / 3.5
    mean = coded[0].whole().decoded()
    assert float((mean - expected).norm() / expected.norm()) < 0.01
    mixed: list[torch.Tensor | CodedDelta] = [_coded(v, block) for v in values[:2]] + [held[2].clone()]
    asyncio.run(main(mixed))
    assert isinstance(mixed[2], torch.Tensor) and torch.allclose(mixed[2], mean, atol=1e-6)


def test_a_dead_reducers_part_keeps_the_members_own_codes_where_its_stand_in_is_dead_too():
    """Parts of dead reducers: the one whose stand-in (peers/stand_in.py) is dead as well keeps
    each member's own codes; the other is averaged at its stand-in, the codes of its mean stored
    alike on both members."""
    n, block = 9_000, 64

    async def main():
        peers = await start_peers(2)
        dead = [Member("peer98", "127.0.0.1:1"), Member("peer99", "127.0.0.1:1")]  # nobody listens there
        members = [p.member for p in peers] + dead
        plan = make_plan("test-run", 0, 0, members, n, block, 1024, INT8)
        try:
            return plan, await asyncio.gather(
                *(
                    butterfly_allreduce(plan, p.member.peer_id, c, 1.0, c, p.registry, p.channels, timeout=3.0)
                    for p, c in zip(peers, coded)
                )
            )
        finally:
            await stop_peers(peers)

    coded = [_coded(torch.randn(n), block) for _ in range(2)]
    before = [c.codes.clone() for c in coded]
    plan, reports = asyncio.run(main())
    offset, length = plan.parts[plan.index_of("peer98")]
    for c, old, report in zip(coded, before, reports):
        assert torch.equal(c.codes[offset : offset + length], old[offset : offset + length])
        assert [p.reducer for p in report.failed_parts] == ["peer98"]
        assert [p.stood_in_for for p in report.parts if p.stood_in_for] == ["peer99"]
    averaged = torch.ones(n, dtype=torch.bool)
    averaged[offset : offset + length] = False
    assert torch.equal(coded[0].codes[averaged], coded[1].codes[averaged])


def test_a_coded_delta_is_refused_where_its_blocks_are_not_the_plans():
    """Its codes go out as they are: another codec, another block size, or the wire's own
    feedback (already taken when it was coded) would silently change what is averaged."""
    coded = _coded(torch.randn(4096), 256)
    member = Member("peer00", "127.0.0.1:1")
    for codec, block, feedback in ((FP32, 256, None), (INT8, 128, None), (INT8, 256, Feedback(torch.zeros(4096)))):
        plan = make_plan("test-run", 0, 0, [member], 4096, block, 1024, codec)
        with pytest.raises(ValueError, match="coded"):
            asyncio.run(butterfly_allreduce(plan, "peer00", coded, 1.0, coded, None, None, 1.0, feedback=feedback))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="coded"):
        plan = make_plan("test-run", 0, 0, [member], 4096, 256, 1024, INT8)
        asyncio.run(butterfly_allreduce(plan, "peer00", coded, 1.0, torch.empty(4096), None, None, 1.0))  # type: ignore[arg-type]


@pytest.mark.parametrize("coded", [False, True])
def test_an_averaged_delta_is_held_to_a_few_of_the_nodes_own_with_room_for_a_node_that_trained_less(coded):
    """A mean 10x this node's own Δ is scaled down to OUTER_REACH x it; a node whose average
    group-mate made twice its steps (or tokens) takes up to 4x that, and no shortfall, however
    large or unknown, lifts the bound past MAX_ALLOWANCE."""
    r = _replica(coded)
    r.trainer.parameters_flat.add_(torch.randn(r.numel, generator=torch.Generator().manual_seed(5)) * 1e-2)
    own = torch.linalg.vector_norm(r.theta_g - r.trainer.parameters_flat).item()

    def length_after(ratio: float, times: float, rate: float = 1.0) -> float:
        r.bounds.allow_for_shortfall(ratio, rate)
        mean = r.pseudo_gradient()  # this node's own Δ, staged where the average lands
        if isinstance(mean, CodedDelta):
            mean.scales.mul_(times)
            return r.bounds.bounded(mean).norm().item()
        return torch.linalg.vector_norm(r.bounds.bounded(mean.mul_(times))).item()

    assert length_after(1.0, 10.0) == pytest.approx(OUTER_REACH * own, rel=1e-3)
    assert length_after(2.0, 10.0) == pytest.approx(10.0 * own, rel=1e-3)
    assert length_after(2.0, 20.0) == pytest.approx(OUTER_REACH * 4 * own, rel=1e-3)
    assert length_after(math.inf, 1e6) == pytest.approx(OUTER_REACH * MAX_ALLOWANCE * own, rel=1e-3)
    assert length_after(0.5, 2.0) == pytest.approx(2.0 * own, rel=1e-3)  # never below its own reach
    assert r.bounds.outer_steps_scaled == 3
    # a joiner warming up again trained at a twentieth of the swarm's rate: its own schedule, not
    # a peer's report, lifts the bound past MAX_ALLOWANCE by that much
    assert length_after(math.inf, 1e6, 20.0) == pytest.approx(OUTER_REACH * MAX_ALLOWANCE * 20 * own, rel=1e-3)
    assert length_after(1.0, 10.0, 0.5) == pytest.approx(OUTER_REACH * own, rel=1e-3)  # a higher rate: no less
    assert length_after(1.0, 10.0, math.nan) == pytest.approx(OUTER_REACH * own, rel=1e-3)


def _steps_along(r: Replica, means: list[torch.Tensor]) -> list[float]:
    """‖θ_g after − θ_g before‖ of each outer step along `means` (each coded first on a coded replica)."""
    sizes = []
    for values in means:
        mean: torch.Tensor | CodedDelta = values.clone()
        if r.coded:
            mean = CodedDelta(r.numel, 256)
            mean.whole().store_values(values)
        before = r.theta_g.clone()
        r.apply_outer_step(mean)
        sizes.append(torch.linalg.vector_norm(r.theta_g - before).item())
    return sizes


@pytest.mark.parametrize("coded", [False, True])
def test_a_mean_pushed_one_way_round_after_round_does_not_build_the_momentum_past_its_reach(coded):
    """Issue 56: each averaged Δ is held to OUTER_REACH x this node's own, but a member pushing
    the mean to that bound in one direction every round had the momentum add the rounds up, and
    the outer steps grew to lr·(3 + 3μ/(1−μ)) own Δ (30 at μ = 0.9, where 3 + 3μ is 5.7). The momentum
    is now held to what means no longer than its own Δ could build (1/(1−μ) of it), so a step
    stays within lr·(3 + μ/(1−μ)) own Δ; honest means, however aligned, are never scaled."""
    gen = torch.Generator().manual_seed(7)
    r = _replica(coded)
    r.trainer.parameters_flat.add_(torch.randn(r.numel, generator=gen) * 1e-2)
    own = torch.linalg.vector_norm(r.theta_g - r.trainer.parameters_flat).item()
    r.pseudo_gradient()  # this node's own Δ: the scale its bounds hold the swarm to
    lr, mu = r.outer.lr, r.outer.momentum
    one_way = torch.randn(r.numel, generator=gen)
    aligned = one_way * (0.97 * own / torch.linalg.vector_norm(one_way))  # an honest mean: no longer than its own
    honest = _steps_along(r, [aligned] * 60)
    assert r.bounds.momenta_scaled == 0 and r.bounds.outer_steps_scaled == 0
    assert honest[-1] > 0.9 * lr * (1 + mu / (1 - mu)) * 0.97 * own  # it built its momentum up whole
    hostile = _steps_along(r, [aligned * 10] * 40)  # every mean scaled down to OUTER_REACH x own
    assert r.bounds.outer_steps_scaled == 40 and r.bounds.momenta_scaled > 0
    assert max(hostile) <= lr * (OUTER_REACH + mu / (1 - mu)) * own * 1.01
    assert max(hostile) > lr * (OUTER_REACH + mu * OUTER_REACH) * own  # the bound is the momentum's, not below it


@pytest.mark.parametrize("coded", [False, True])
def test_a_node_that_trained_no_steps_takes_the_groups_mean_whole(coded):
    """A node that joined at a round's end has a Δ of 0: nothing to bound the mean by, so it is
    taken as it came (a bound of 0 x its Δ zeroed it, and the node's θ_g split from its group's)."""
    r = _replica(coded)
    empty = r.pseudo_gradient()
    assert r.bounds.own_scale() is None
    if isinstance(empty, CodedDelta):
        empty.scales.fill_(1.0)
        empty.codes.fill_(1)
        assert r.bounds.bounded(empty).norm().item() > 0
    else:
        assert torch.linalg.vector_norm(r.bounds.bounded(empty.fill_(1.0))).item() > 0
    assert r.bounds.outer_steps_scaled == 0


@pytest.mark.parametrize("coded", [False, True])
def test_a_resynced_state_moves_this_nodes_as_a_whole_no_farther_than_its_bound(coded):
    """A re-sync whose parts each passed their share of the bound can still move the whole state
    farther (a pair's member took both parts to their limit, twice the bound): the state taken is
    moved toward the re-synced one only to the bound, θ_g and the momentum each; a state within
    the bound is taken as it came, and a non-finite one not at all."""
    r = _replica(coded)
    n = r.numel
    r.trainer.parameters_flat.add_(torch.randn(n, generator=torch.Generator().manual_seed(5)) * 1e-2)
    r.pseudo_gradient()
    r.outer.momentum_buffer.normal_(generator=torch.Generator().manual_seed(6))
    drift = r.bounds.resync_bound(0)
    assert 0 < drift.theta and 0 < drift.momentum
    theta0, momentum0 = r.theta_g.clone(), r.outer.momentum_buffer.clone()
    away = torch.randn(2 * n, generator=torch.Generator().manual_seed(7))
    far = r.consensus_state() + away * (10 * max(drift.theta, drift.momentum) / float(away.norm()))
    take = r.land if coded else lambda _, state: r._take_consensus(state)  # (landing without a mean)
    take(None, far)
    assert float((r.theta_g - theta0).norm()) == pytest.approx(drift.theta, rel=1e-4)
    assert float((r.outer.momentum_buffer - momentum0).norm()) == pytest.approx(drift.momentum, rel=1e-4)
    assert r.resyncs_clipped == 2

    near = r.consensus_state()
    near[:n].add_(drift.theta / 4 / math.sqrt(n))
    take(None, near.clone())
    assert torch.equal(r.theta_g, near[:n]) and r.resyncs_clipped == 2

    before = r.theta_g.clone()
    broken = r.consensus_state()
    broken[3] = math.nan
    take(None, broken)
    assert torch.equal(r.theta_g, before) and r.resyncs_clipped == 3


def test_a_round_reports_the_mean_rate_its_steps_took_which_a_fresh_optimizer_warms_up_to():
    """What `allow_for_shortfall`'s rate compares with the swarm's: a joiner's fresh optimizer at
    the swarm's position 100 of a 50-step warmup steps at a fiftieth of the rate, then two."""
    schedule = LearningRateSchedule(1e-3, warmup_steps=50)
    model, _ = build_model("tiny", seed=1)
    language = MarkovLanguage(seed=2)
    trainer = Trainer(
        model,
        DataStream(DataSources(language, language), "run", "a", 2, 16),
        torch.device("cpu"),
        schedule=schedule,
        weight_decay=0.1,
        grad_clip=1.0,
    )
    inner = trainer.run(2, threading.Event(), position=100, span=10)
    assert inner.steps == 2
    assert inner.mean_lr == pytest.approx((schedule(100, 0) + schedule(101, 1)) / 2)
    assert inner.mean_lr == pytest.approx(schedule(100) * 1.5 / 50)
    assert trainer.run(0, threading.Event(), position=110, span=10).mean_lr == 0.0


def test_a_round_without_a_step_takes_the_rate_of_the_last_round_with_steps():
    """CI: a 4x slower peer warming up at 2e-05-4e-05 (its own schedule's first steps) against
    the swarm's 1e-3 drew no step in round 2; its rate counted as the swarm's, it clipped the
    group's mean (2.549 long) to 48x its own longest Δ (0.0097) alone and split its θ_g. The
    rate behind its own Δ is that of the last round it took steps in."""
    r = _replica(False)
    r.trainer.parameters_flat.add_(torch.randn(r.numel, generator=torch.Generator().manual_seed(7)) * 1e-4)
    own = torch.linalg.vector_norm(r.theta_g - r.trainer.parameters_flat).item()
    fresh = r.bounds.rate_shortfall(1e-3, 0.0)
    assert fresh == 1.0  # no step yet: nothing to compare with
    assert r.bounds.rate_shortfall(1e-3, 4e-5) == pytest.approx(25.0)  # a round of warm-up steps
    rate = r.bounds.rate_shortfall(1e-3, 0.0)  # a round without a step
    assert rate == pytest.approx(25.0)
    r.bounds.allow_for_shortfall(math.inf, rate)
    mean = r.pseudo_gradient().mul_(260.0)  # the swarm's mean, 260x this node's own Δ
    assert torch.linalg.vector_norm(r.bounds.bounded(mean)).item() == pytest.approx(260.0 * own, rel=1e-4)
    assert r.bounds.outer_steps_scaled == 0


@pytest.mark.parametrize("coded", [False, True])
def test_a_node_whose_group_trained_more_than_the_swarms_progress_said_takes_their_mean_whole(coded):
    """A swarm's first round: this node trained its share (no allowance from the swarm's
    progress), and its group-mates trained on after its last read, to 3x its tokens: the group's
    registrations allow 9x, a bound of 27x its own Δ: their mean of 10x is taken whole (at 3x, it
    was scaled down alone, and θ_g split)."""
    r = _replica(coded)
    r.trainer.parameters_flat.add_(torch.randn(r.numel, generator=torch.Generator().manual_seed(6)) * 1e-2)
    own = torch.linalg.vector_norm(r.theta_g - r.trainer.parameters_flat).item()
    r.bounds.allow_for_shortfall(1.0, 1.0)
    r.bounds.allow_for_group(3.0)
    mean = r.pseudo_gradient()
    if isinstance(mean, CodedDelta):
        mean.scales.mul_(10.0)
        assert r.bounds.bounded(mean).norm().item() == pytest.approx(10.0 * own, rel=1e-3)
    else:
        assert torch.linalg.vector_norm(r.bounds.bounded(mean.mul_(10.0))).item() == pytest.approx(10.0 * own, rel=1e-3)
    r.bounds.allow_for_group(0.5)  # a lighter group lowers nothing
    r.bounds.allow_for_group(math.inf)
    assert r.bounds.allowance == 9.0
    r.bounds.allow_for_group(100.0)  # held to MAX_ALLOWANCE like a report
    assert r.bounds.allowance == MAX_ALLOWANCE
