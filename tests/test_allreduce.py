"""The gRPC butterfly all-reduce against a plain torch weighted mean, on real loopback servers."""

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
import torch
from allreduce_harness import allreduce, allreduce_beside, send_to_each_reducer, start_peers, stop_peers, stream_status

from dtnode.ops import sparse
from dtnode.ops.quantization import quantize
from dtnode.peers.butterfly import ButterflyAllReduce, butterfly_allreduce
from dtnode.peers.deadlines import expected_payload_bytes
from dtnode.peers.part_codec import Feedback
from dtnode.peers.part_result import DriftBound
from dtnode.peers.plan import FP32, INT8, SPARSE, Compression, Member, WireFormat, make_plan
from dtnode.peers.reduction_registry import ReductionRegistry
from dtnode.peers.stand_in import stand_in
from dtnode.peers.wire import chunk_message
from dtnode.proto import averaging_pb2 as pb
from dtnode.proto import averaging_pb2_grpc as pb_grpc

# Two int8 quantizations (sender, then the reducer's mean), each ≤ ~0.8% on Gaussian data.
INT8_BOUND = 0.02


def run(coro):
    return asyncio.run(coro)


def exact_mean(values, weights):
    return sum(w * v for w, v in zip(weights, values)) / sum(weights)


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "n,numel,client_mode",
    [
        (1, 1000, ()),
        (2, 1000, ()),
        (3, 100_003, ()),
        (4, 5_000, (2,)),
        (5, 77_777, (1,)),
        (5, 12_345, ()),
    ],
)
def test_matches_exact_weighted_mean(n, numel, client_mode):
    async def main():
        peers = await start_peers(n, client_mode=client_mode)
        gen = torch.Generator().manual_seed(n * numel)
        values = [torch.randn(numel, generator=gen) * (i + 1) for i in range(n)]
        weights = [float(100 * (i + 1)) for i in range(n)]
        try:
            outs, reports = await allreduce(peers, values, weights, chunk_elements=1024)
        finally:
            await stop_peers(peers)
        expected = exact_mean(values, weights)
        for out, report in zip(outs, reports):
            assert rel(out, expected) <= INT8_BOUND
            assert not report.failed_parts
            assert report.included_peers == sorted(p.member.peer_id for p in peers)
        # one answer per group: every member applies the same bytes
        for out in outs[1:]:
            assert torch.equal(out, outs[0])

    run(main())


def test_fp32_codec_is_exact_to_float_rounding():
    async def main():
        peers = await start_peers(3)
        values = [torch.randn(10_001) for _ in range(3)]
        try:
            outs, _ = await allreduce(peers, values, [1.0, 2.0, 3.0], codec=FP32, chunk_elements=1024)
        finally:
            await stop_peers(peers)
        assert torch.allclose(outs[0], exact_mean(values, [1.0, 2.0, 3.0]), atol=1e-5)

    run(main())


@pytest.mark.parametrize("codec,hop", [(FP32, 0), (SPARSE, 0), (INT8, 1), (SPARSE, 1), (FP32, 1)])
def test_two_groups_reducing_the_same_contributions_return_the_same_bits(codec, hop):
    """Moshpit can have two groups reduce the same values (a peer alone in one hop stands in
    two classes of the next), with different reducers and arrival orders. fp32 sums in another
    order differ in the last bit, which would leave the two groups with different θ_g hashes
    and, with no scheduled re-sync (sparse), apart for good. Here the second group holds the
    first one's values rotated by one member, and its members advertise other bandwidths, one
    of them in client mode, so its parts have other reducers and other bounds. (int8 only
    after hop 0: no two groups of hop 0 share a contribution.)"""

    async def main():
        numel = 3 * 4096 + 5
        gen = torch.Generator().manual_seed(31)
        common = torch.randn(numel, generator=gen)  # shared, so sparse members keep the same positions
        values = [common + 0.1 * torch.randn(numel, generator=gen) for _ in range(3)]
        weights = [0.3, 1.7, 2.9]
        rotated = [2, 0, 1]
        options = {
            "codec": codec,
            "hop": hop,
            "block_size": 4096,
            "chunk_elements": 8192,
            "top_k": 512 if codec == SPARSE else 0,
        }
        first = await start_peers(3, run_id="group-a")
        second = await start_peers(3, run_id="group-b", bandwidths=[3.0, 1.0, 1.5], client_mode=(1,))
        try:
            (outs_a, _), (outs_b, _) = await asyncio.gather(
                allreduce(first, values, weights, run_id="group-a", **options),
                allreduce(
                    second, [values[i] for i in rotated], [weights[i] for i in rotated], run_id="group-b", **options
                ),
            )
        finally:
            await stop_peers(first + second)
        assert all(torch.equal(out, outs_a[0]) for out in outs_a + outs_b)
        if codec == FP32:
            assert rel(outs_a[0], exact_mean(values, weights)) < 1e-6
        elif codec == INT8:
            assert rel(outs_a[0], exact_mean(values, weights)) < INT8_BOUND
        elif hop == 0:  # the mean of what the members kept, in the 8-bit code of a returned mean
            kept = [sparse.decode(sparse.encode(v, 4096, 512)) for v in values]
            assert rel(outs_a[0], exact_mean(kept, weights)) < 0.01

    run(main())


@pytest.mark.parametrize("trim", [None, 0.25], ids=["mean", "trimmed"])
def test_silent_members_take_the_others_mean_and_move_it_by_no_bit(trim):
    """A θ_g re-sync where a strict majority of the group announced one hash makes the others
    `silent` in its plan: their values do not enter the mean, so the group leaves with the
    majority's θ_g bit for bit. They used to count 2^-20 of their share, which moved every
    member's θ_g by an ulp in about 4 coordinates of 10 (a mean W·A/W is not always A): the
    group then held a θ_g that no other group of the swarm held. Every member reduces a part,
    the silent one included, and every part's `included` still names it: it sent in full."""

    async def main():
        numel = 3 * 4096 + 17
        gen = torch.Generator().manual_seed(56)
        majority = torch.randn(numel, generator=gen) * 0.02
        apart = majority + torch.randn(numel, generator=gen) * 1e-3
        values = [majority.clone(), apart.clone(), majority.clone(), majority.clone()]
        peers = await start_peers(4, run_id="silent")
        members = [p.member for p in peers]
        plan = make_plan("silent", 0, 1, members, numel, 256, 4096, FP32, silent=frozenset({"peer01"}))
        outs = [torch.empty(numel) for _ in range(4)]
        try:
            reports = await asyncio.gather(
                *(
                    butterfly_allreduce(
                        plan, p.member.peer_id, v, w, o, p.registry, p.channels, 10.0, trim_fraction=trim
                    )
                    for p, v, w, o in zip(peers, values, [1.0, 2.0**-20, 0.5, 0.5], outs)
                )
            )
        finally:
            await stop_peers(peers)
        for out, report in zip(outs, reports):
            assert torch.equal(out, majority)
            assert not report.failed_parts and report.included_peers == [m.peer_id for m in plan.members]

    run(main())


def test_a_plan_keeps_a_member_whose_values_count():
    members = [Member(f"p{i}", f"127.0.0.1:{i}") for i in range(3)]
    with pytest.raises(ValueError, match="silent members must be members"):
        make_plan("r", 0, 0, members, 1024, 256, 1024, FP32, silent=frozenset({"p0", "p1", "p2"}))
    with pytest.raises(ValueError, match="silent members must be members"):
        make_plan("r", 0, 0, members, 1024, 256, 1024, FP32, silent=frozenset({"stranger"}))
    loud = make_plan("r", 0, 0, members, 1024, 256, 1024, FP32)
    quiet = make_plan("r", 0, 0, members, 1024, 256, 1024, FP32, silent=frozenset({"p1"}))
    assert loud.group_id != quiet.group_id  # members that disagree on who is silent do not mix chunks


def test_bandwidth_sizes_parts():
    async def main():
        peers = await start_peers(2, bandwidths=[1.0, 3.0])
        values = [torch.randn(64_000) for _ in range(2)]
        try:
            outs, reports = await allreduce(peers, values, [1.0, 1.0])
        finally:
            await stop_peers(peers)
        plan = make_plan("test-run", 0, 0, [p.member for p in peers], 64_000, 64, 1 << 12)
        # peer 0 reduces a quarter: it receives a quarter from peer 1 and returns it averaged
        assert abs(plan.parts[0][1] / 64_000 - 0.25) < 0.01
        assert rel(outs[0], exact_mean(values, [1.0, 1.0])) <= INT8_BOUND
        # every byte one sends, the other receives
        assert reports[0].bytes_sent == reports[1].bytes_received
        assert reports[1].bytes_sent == reports[0].bytes_received

    run(main())


@pytest.mark.parametrize("codec,wire", [(INT8, WireFormat(Compression.INT8, 64)), (FP32, WireFormat(Compression.FP32))])
@pytest.mark.parametrize("n", [2, 3])
def test_the_payload_a_deadline_expects_is_the_payload_an_all_reduce_moves(n, codec, wire):
    """A deadline is margin x expected bytes / measured rate, and a rate is what a member sent
    plus received over the seconds it took: the estimate must count the same bytes, or every
    deadline is a fraction of what its margin says."""

    async def main():
        peers = await start_peers(n)
        try:
            _, reports = await allreduce(peers, [torch.randn(48_000) for _ in range(n)], [1.0] * n, codec=codec)
        finally:
            await stop_peers(peers)
        expected = expected_payload_bytes(48_000, n, wire)
        for report in reports:
            moved = report.bytes_sent + report.bytes_received
            assert 0.9 * expected <= moved <= 1.1 * expected, (moved, expected)

    run(main())


def test_a_dead_reducers_part_goes_to_its_stand_in_and_one_whose_stand_in_is_dead_too_keeps_own_values():
    """Two members of four are dead (nobody listens at their addresses). The part of the one whose
    stand-in, the next reducer of the plan, is alive is averaged there: every member leaves with
    the same bytes. The part of the one whose stand-in is dead too keeps each member's own values."""

    async def main():
        peers = await start_peers(2)  # peer00, peer01; the plan's order is by id
        dead = [Member("peer98", "127.0.0.1:1"), Member("peer99", "127.0.0.1:1")]
        plan = make_plan("test-run", 0, 0, [p.member for p in peers] + dead, 9_000, 64, 1024, INT8)
        values = [torch.randn(9_000) for _ in range(2)]
        outs = [torch.empty(9_000) for _ in range(2)]
        try:
            reports = await asyncio.gather(
                *(
                    butterfly_allreduce(plan, p.member.peer_id, v, 1.0, o, p.registry, p.channels, timeout=3.0)
                    for p, v, o in zip(peers, values, outs)
                )
            )
        finally:
            await stop_peers(peers)
        lost = slice(*_span(plan, "peer98"))  # its stand-in is peer99, dead as well
        for v, o, r in zip(values, outs, reports):
            assert torch.equal(o[lost], v[lost])
            assert [p.reducer for p in r.failed_parts] == ["peer98"]
            assert [p.stood_in_for for p in r.parts if p.stood_in_for] == ["peer99"]  # by peer00, around
        averaged = torch.ones(9_000, dtype=torch.bool)
        averaged[lost] = False
        assert torch.equal(outs[0][averaged], outs[1][averaged])
        assert rel(outs[0][averaged], exact_mean(values, [1.0, 1.0])[averaged]) <= INT8_BOUND

    run(main())


def _span(plan, peer_id: str) -> tuple[int, int]:
    offset, length = plan.parts[plan.index_of(peer_id)]
    return offset, offset + length


def test_a_dead_sender_is_found_within_seconds_not_at_the_reducers_deadline():
    """Issue 56, finding 3: a member killed after its group formed never opens its streams, and
    the reducers waited for them until their deadline (48 s in a 4-node swarm) while the senders
    to its part had seen "failed to connect" at once. A reducer now dials the senders whose
    stream has not begun: two failed dials in a row and the sender is dropped from the part."""

    async def main():
        peers = await start_peers(2)
        dead = Member("peer99", "127.0.0.1:1")  # nobody listens there
        plan = make_plan("test-run", 0, 0, [p.member for p in peers] + [dead], 9_000, 64, 1024, INT8)
        values = [torch.randn(9_000) for _ in range(2)]
        outs = [torch.empty(9_000) for _ in range(2)]
        started = time.monotonic()
        try:
            reports = await asyncio.gather(
                *(
                    butterfly_allreduce(plan, p.member.peer_id, v, 1.0, o, p.registry, p.channels, timeout=60.0)
                    for p, v, o in zip(peers, values, outs)
                )
            )
        finally:
            await stop_peers(peers)
        took = time.monotonic() - started
        assert took < 10, took  # the deadline was 60 s (48 s for the reducers)
        for report in reports:
            assert report.included_peers == ["peer00", "peer01"]
            assert not report.failed_parts
            assert [p.stood_in_for for p in report.parts if p.stood_in_for] == ["peer99"]

    run(main())


def _plan_of_chunks(peers, round_no, hop, codec, chunks_per_part, block=256):
    """A plan of these peers whose parts are `chunks_per_part` chunks of one block each."""
    members = [p.member for p in peers]
    numel = len(members) * chunks_per_part * block
    return make_plan("test-run", round_no, hop, members, numel, block, block, codec, top_k=16 if codec == SPARSE else 0)


async def _each_member_then_stop(plan, peers, values, outs, timeout=20.0):
    """Every peer that has values (the first len(values)) all-reduces them at once; then the peers stop."""
    try:
        return await asyncio.wait_for(
            asyncio.gather(
                *(
                    butterfly_allreduce(plan, p.member.peer_id, v, 1.0, o, p.registry, p.channels, timeout=timeout)
                    for p, v, o in zip(peers, values, outs)
                )
            ),
            timeout + 10,
        )
    finally:
        await stop_peers(peers)


@pytest.mark.parametrize("codec,hop", [(SPARSE, 0), (INT8, 1)])
def test_a_member_that_formed_other_groups_is_dropped_at_once_and_the_others_average_in_full(codec, hop):
    """Two members count a third in their group of a hop, but the third formed its groups of
    that hop with other members (views differ after a pause or a restart, or the grid's cells
    fell otherwise for it). Its service says so (NOT_FOUND) and each of the two drops it from
    the part it reduces at once. Before, the two reductions, which hold their senders' chunks
    here (sparse, and any hop after the first), waited for it until their deadline and then
    dropped each other as well: every part failed, after most of the timeout (seen in a swarm
    of 6 `small` nodes with a paused and a restarted one: 51 s in one hop, and two nodes left
    θ_g). Now the two average their two parts in full, bit for bit alike, well before it, and
    the third's part at its stand-in."""

    async def main():
        peers = await start_peers(3)
        plan = _plan_of_chunks(peers, 4, hop, codec, chunks_per_part=8)  # more than a reduction holds per sender
        numel = plan.numel
        absent = peers[2]
        absent.registry.hop_begins("test-run", 4, hop, slots=1)
        absent.registry.slot_settled("test-run", 4, hop, b"its own group")
        gen = torch.Generator().manual_seed(5)
        values = [torch.randn(numel, generator=gen) for _ in range(2)]
        outs = [torch.empty(numel) for _ in range(2)]
        started = asyncio.get_running_loop().time()
        reports = await _each_member_then_stop(plan, peers, values, outs)
        assert asyncio.get_running_loop().time() - started < 10  # the reducer deadline is at 16 s
        for r in reports:  # its part went to its stand-in (peers/stand_in.py)
            assert not r.failed_parts
            assert [p.stood_in_for for p in r.parts if p.stood_in_for] == [absent.member.peer_id]
        assert torch.equal(outs[0], outs[1])
        assert not torch.equal(outs[0], values[0])

    run(main())


@pytest.mark.parametrize("codec,hop", [(SPARSE, 0), (INT8, 1)])
def test_a_reducer_that_forms_the_group_after_its_registration_wait_is_asked_again(codec, hop):
    """A member forms the group seconds after another (it polls the DHT for the group's list,
    or is still in the hop before): a stream that reached it first is answered "no reduction
    for this group" after the registration wait (2 s here). Before, the sender kept its own
    values for that part at once while that reducer, once formed, waited for its stream until
    the deadline and then returned a mean without it: the two left the round with different
    values there (seen in a swarm of 6 `small` nodes: a group of round 0 split θ_g four ways).
    Now the sender asks again while time is left, and the part is averaged in full."""

    async def main():
        peers = await start_peers(2)
        plan = _plan_of_chunks(peers, 2, hop, codec, chunks_per_part=4)
        numel = plan.numel
        gen = torch.Generator().manual_seed(6)
        values = [torch.randn(numel, generator=gen) for _ in range(2)]
        outs = [torch.empty(numel) for _ in range(2)]

        async def member(i: int, late: float):
            await asyncio.sleep(late)
            p = peers[i]
            return await butterfly_allreduce(
                plan, p.member.peer_id, values[i], 1.0, outs[i], p.registry, p.channels, 20.0
            )

        try:
            reports = await asyncio.wait_for(asyncio.gather(member(0, 0.0), member(1, 4.5)), 30)
        finally:
            await stop_peers(peers)
        assert [r.failed_parts for r in reports] == [[], []]
        assert "FAILED_PRECONDITION" in reports[0].retried
        assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], values[0])

    run(main())


def test_a_member_still_forming_its_groups_is_waited_for_though_its_record_is_missing():
    """A member forms its group seconds after the others (its host loaded, its DHT reads slow):
    its `formed` record is missing past the lag, and its group-mates took it for absent, kept
    their own values for its part and dropped it from theirs, while other members took its mean
    (a hop-1 group of 10 at 32 nodes on 2 cores ended on six θ_g). Its "not yet" answer now says
    it is still forming the hop's groups: that member is waited for, and the part is averaged
    in full. One that says nothing of the kind is absent as before."""

    async def main():
        peers = await start_peers(2)
        plan = _plan_of_chunks(peers, 2, 1, INT8, chunks_per_part=2)
        numel = plan.numel
        values = [torch.randn(numel) for _ in range(2)]
        outs = [torch.empty(numel) for _ in range(2)]
        late = peers[1].member.peer_id
        peers[1].registry.hop_begins("test-run", 2, 0, 1)  # in the hop before: on its way

        async def no_record_from_late(forming):
            return {late} - set(forming)

        async def member(i: int, delay: float):
            await asyncio.sleep(delay)
            p = peers[i]
            return await butterfly_allreduce(
                plan, p.member.peer_id, values[i], 1.0, outs[i], p.registry, p.channels, 20.0,
                absent=no_record_from_late if i == 0 else None,
            )  # fmt: skip

        try:
            reports = await asyncio.wait_for(asyncio.gather(member(0, 0.0), member(1, 3.0)), 30)
        finally:
            await stop_peers(peers)
        assert [r.failed_parts for r in reports] == [[], []]
        assert [r.included_peers for r in reports] == [["peer00", "peer01"]] * 2
        assert torch.equal(outs[0], outs[1])

    run(main())


def test_the_registry_says_a_group_is_elsewhere_only_once_every_slot_of_the_hop_has_its_group():
    """A peer that stands in two classes of a hop forms two groups, one after the other: until
    both are formed, a plan it does not know yet may still be one of them."""
    registry = ReductionRegistry()
    other = ReductionRegistry.key("run", 7, 1, b"other", 0)
    mine = ReductionRegistry.key("run", 7, 1, b"mine", 0)
    assert not registry.elsewhere(other)  # the hop has not begun here
    registry.hop_begins("run", 7, 1, slots=2)
    registry.slot_settled("run", 7, 1, b"mine")
    assert not registry.elsewhere(other)  # the second slot is still forming
    registry.slot_settled("run", 7, 1, None)  # a group of one
    assert registry.elsewhere(other) and not registry.elsewhere(mine)
    assert not registry.elsewhere(ReductionRegistry.key("run", 7, 3, b"other", 0))  # θ_g's re-sync hop, or another
    registry.hop_begins("run", 7 + ReductionRegistry.KEPT_ROUNDS, 0, slots=1)
    assert not registry.elsewhere(other)  # forgotten with its round


def test_a_lookup_cut_off_while_its_wait_times_out_leaves_the_registry_whole():
    """A sender's stream may be cut (its deadline, the peer gone) just as the reducer's wait for
    its group times out. With the wait on an asyncio.Condition under `asyncio.wait_for`, the cut
    came while the timed-out wait was re-taking the lock, and the handler then released a lock
    it did not hold: a RuntimeError traceback in a 32-node swarm's log. Lookups hold no lock now;
    every one ends with the reduction, None or its cancellation, and later ones still find theirs."""

    async def main():
        registry = ReductionRegistry()
        key = ReductionRegistry.key("run", 1, 0, b"group", 0)
        lookups = [asyncio.create_task(registry.lookup(key, 0.05)) for _ in range(200)]
        await asyncio.sleep(0.05)  # their waits end together: cut off every other one meanwhile
        for task in lookups[::2]:
            await asyncio.sleep(0)
            task.cancel()
        done = await asyncio.gather(*lookups, return_exceptions=True)
        assert all(r is None or isinstance(r, asyncio.CancelledError) for r in done), done
        later = asyncio.create_task(registry.lookup(key, 5.0))
        await asyncio.sleep(0.01)
        reduction = SimpleNamespace(plan=SimpleNamespace(run_id="run", round=1, hop=0, group_id=b"group"), part=0)
        reduction.start = reduction.stop = lambda: None
        await registry.register(reduction)
        assert await later is reduction and await registry.lookup(key, 0.0) is reduction

    asyncio.run(main())


def test_a_mean_that_cannot_be_finished_fails_its_part_at_once_and_everyone_keeps_own_values():
    """A reducer whose own values there are not finite cannot quantize the mean: the part
    fails for every member (ABORTED), in well under the timeout, instead of leaving the
    reducer waiting for its own result forever; the other parts average as usual."""

    async def main():
        peers = await start_peers(3)
        plan = make_plan("test-run", 0, 0, [p.member for p in peers], 9_000, 64, 1024, INT8)
        values = [torch.randn(9_000) for _ in range(3)]
        offset, length = plan.parts[0]
        values[0][offset + 5] = float("inf")  # in the part peer00 reduces
        outs = [torch.empty(9_000) for _ in range(3)]
        started = asyncio.get_running_loop().time()
        reports = await _each_member_then_stop(plan, peers, values, outs)
        assert asyncio.get_running_loop().time() - started < 10
        for v, o, r in zip(values, outs, reports):
            assert torch.equal(o[offset : offset + length], v[offset : offset + length])
            assert [p.reducer for p in r.failed_parts] == ["peer00"]
        assert {r.failed_parts[0].error.split(":")[0] for r in reports} == {"REDUCTION_FAILED", "ABORTED"}
        rest = torch.ones(9_000, dtype=torch.bool)
        rest[offset : offset + length] = False
        assert rel(outs[1][rest], exact_mean(values, [1.0] * 3)[rest]) <= INT8_BOUND

    run(main())


def _chunk(plan, part, sender, offset, values, **overrides):
    q = quantize(values, plan.block_size)
    fields = {
        "run_id": plan.run_id,
        "round": plan.round,
        "hop": plan.hop,
        "group_id": plan.group_id,
        "part": part,
        "sender": sender,
        "weight": 1.0,
        "offset": offset,
        "length": values.numel(),
        "codec": plan.codec,
        "block_size": plan.block_size,
        "values": q.codes.numpy().tobytes(),
        "scales": q.scales.numpy().tobytes(),
        "last": True,
    }
    fields.update(overrides)
    return pb.PartChunk(**fields)


HOSTILE = {
    "nan scale": lambda c: c.__setattr__("scales", torch.full((len(c.scales) // 4,), float("nan")).numpy().tobytes()),
    "short payload": lambda c: c.__setattr__("values", c.values[:-1]),
    "wrong round": lambda c: c.__setattr__("round", c.round + 1),
    "unknown sender": lambda c: c.__setattr__("sender", "peer-evil"),
    "huge weight": lambda c: c.__setattr__("weight", 1e30),
    # finite scales whose values overflow fp32 once decoded or weighted: the mean would be inf
    "overflowing scale": lambda c: c.__setattr__("scales", torch.full((len(c.scales) // 4,), 3e38).numpy().tobytes()),
    "huge values x weight": lambda c: (
        c.__setattr__("scales", torch.full((len(c.scales) // 4,), 1e30).numpy().tobytes()),
        c.__setattr__("weight", 1e12),
    ),
    "wrong offset": lambda c: c.__setattr__("offset", 64),
    "oversized length": lambda c: c.__setattr__("length", 1 << 30),
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_hostile_member_is_rejected_and_others_unaffected(attack):
    async def main():
        peers = await start_peers(2)
        hostile = Member("peer-hostile", "", client_mode=True)
        plan = make_plan("test-run", 5, 0, [p.member for p in peers] + [hostile], 4096, 64, 4096, INT8)
        values = [torch.randn(4096) for _ in range(2)]
        outs = [torch.empty(4096) for _ in range(2)]

        def hostile(part, length):
            chunk = _chunk(plan, part, "peer-hostile", 0, torch.randn(length))
            HOSTILE[attack](chunk)
            return chunk

        try:
            attacker = send_to_each_reducer(plan, peers, hostile)
            reports, codes = await allreduce_beside(plan, peers, values, outs, attacker)
        finally:
            await stop_peers(peers)
        assert all(c in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION) for c in codes), codes
        expected = exact_mean(values, [1.0, 1.0])
        for out, report in zip(outs, reports):
            assert rel(out, expected) <= INT8_BOUND
            assert "peer-hostile" not in report.included_peers
        assert torch.equal(outs[0], outs[1])

    run(main())


def _stream_of(plan, part, sender, values, weight=1.0):
    """The chunks an honest sender would send for its slice of `part`."""
    offset, length = plan.parts[part]
    spans = [(o, min(plan.chunk_elements, length - o)) for o in range(0, length, plan.chunk_elements)]
    chunks = [chunk_message(plan, part, sender, weight, o, values[offset + o : offset + o + n]) for o, n in spans]
    chunks[-1].last = True
    return chunks


async def _two_peers_and_a_ghost():
    """Two real peers and a client-mode member driven by hand ("peer-ghost"), an fp32 plan of 8
    chunks of 1,024 values; the values of all three, and the two peers' outputs."""
    peers = await start_peers(2)
    ghost = Member("peer-ghost", "", client_mode=True)
    plan = make_plan("test-run", 1, 0, [p.member for p in peers] + [ghost], 8192, 64, 1024, FP32)
    return peers, plan, [torch.randn(8192) for _ in range(3)], [torch.empty(8192) for _ in range(2)]


def test_results_stream_back_while_senders_still_send_and_a_sender_dying_mid_stream_counts_only_in_its_chunks():
    """A hand-driven sender sends chunk 0, waits for result chunk 0 (which only a pipelined
    reducer can return at that point), then dies. Chunk 0 of every part averages all three
    senders; the rest averages the two that finished; nobody waits for the timeout."""

    async def main():
        peers, plan, values, outs = await _two_peers_and_a_ghost()
        chunk = plan.chunk_elements
        first_result_before_rest = []

        async def ghost_sender(peer):
            part = plan.index_of(peer.member.peer_id)
            stream = _stream_of(plan, part, "peer-ghost", values[2])
            outgoing: asyncio.Queue = asyncio.Queue()
            outgoing.put_nowait(stream[0])

            async def requests():
                while True:
                    yield await outgoing.get()

            async with grpc.aio.insecure_channel(peer.member.grpc_addr) as channel:
                call = pb_grpc.AveragingStub(channel).Reduce(requests(), timeout=10)
                reply = await call.read()
                first_result_before_rest.append(reply.offset == 0 and reply.length == chunk)
                call.cancel()  # dies with 7 of 8 chunks unsent

        try:
            # the deadline is 10 minutes: only a sender dropped as soon as its stream dies lets
            # this finish before the hang guard
            *reports, _, _ = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        butterfly_allreduce(plan, p.member.peer_id, v, 1.0, o, p.registry, p.channels, timeout=600.0)
                        for p, v, o in zip(peers, values, outs)
                    ),
                    *(ghost_sender(p) for p in peers),
                ),
                120,
            )
        finally:
            await stop_peers(peers)
        assert first_result_before_rest == [True, True]
        expected = exact_mean(values[:2], [1.0, 1.0])
        for offset, length in plan.parts:
            if length == 0:
                continue
            head = slice(offset, offset + chunk)
            torch.testing.assert_close(outs[0][head], exact_mean([v[head] for v in values], [1.0] * 3))
            rest = slice(offset + chunk, offset + length)
            torch.testing.assert_close(outs[0][rest], expected[rest])
        assert torch.equal(outs[0], outs[1])
        for report in reports:
            assert report.included_peers == ["peer00", "peer01"]
            assert not report.failed_parts

    run(main())


@pytest.mark.parametrize("codec", [INT8, SPARSE])
def test_a_member_that_comes_after_the_reducers_deadline_takes_the_groups_mean_without_its_values(codec):
    """A member that comes to its group after the reducers' deadline (its host loaded, its
    group formed late) was refused and kept its own values in every part, while its group-mates
    took the mean: it carried another value of the parts into the next hop, and the grid's last
    hop ended on different θ_g (32 nodes on 2 cores). It now takes the group's mean, without
    its values: every member leaves with the same bytes, and the late one's report says that
    the mean lacks it. A member on time whose stream was held back by the late one's chunks
    (a sender runs at most AHEAD_CHUNKS ahead of the mean; 5 chunks a part here) is not dropped
    with it: it had a grace to finish, and the mean holds it."""

    async def main():
        peers = await start_peers(3, client_mode=(2,))
        plan = make_plan(
            "test-run", 0, 0, [p.member for p in peers], 9_000, 64, 1024, codec, top_k=16 if codec == SPARSE else 0
        )
        values = [torch.randn(9_000) for _ in range(3)]
        outs = [torch.empty(9_000) for _ in range(3)]
        on_time_s = 3.0  # the reducers stop waiting at 0.8 x this, and serve the mean for as long after

        async def late():
            await asyncio.sleep(on_time_s)
            late_peer = peers[2]
            return await butterfly_allreduce(
                plan, "peer02", values[2], 1.0, outs[2], late_peer.registry, late_peer.channels, timeout=10.0
            )

        try:
            *on_time, late_report = await asyncio.gather(
                *(
                    butterfly_allreduce(plan, p.member.peer_id, v, 1.0, o, p.registry, p.channels, timeout=on_time_s)
                    for p, v, o in zip(peers[:2], values, outs)
                ),
                late(),
            )
        finally:
            await stop_peers(peers)
        for report in [*on_time, late_report]:
            assert not report.failed_parts, report.failed_parts
            assert report.included_peers == ["peer00", "peer01"]
        assert torch.equal(outs[2], outs[0]) and torch.equal(outs[1], outs[0])
        assert late_report.weight_after(1.0) == 2.0  # the mean stands for the two it holds
        if codec == INT8:
            assert rel(outs[0], exact_mean(values[:2], [1.0, 1.0])) <= INT8_BOUND

    run(main())


def test_a_sender_whose_stream_broke_midway_takes_the_mean_on_its_next_stream():
    """A sender's stream that broke after a chunk drops it from the part (only its chunks in
    full count); its stream sent again is not refused: it takes the part's mean back, the
    bytes the other members take. (It sends nothing to the other part, whose reducer drops it
    at its deadline.)"""

    async def main():
        peers, plan, values, outs = await _two_peers_and_a_ghost()
        reducer = peers[0]
        part = plan.index_of(reducer.member.peer_id)
        offset, length = plan.parts[part]
        stream = _stream_of(plan, part, "peer-ghost", values[2])

        async def ghost_sender():
            async with grpc.aio.insecure_channel(reducer.member.grpc_addr) as channel:
                stub = pb_grpc.AveragingStub(channel)
                first: asyncio.Queue = asyncio.Queue()
                first.put_nowait(stream[0])

                async def one_chunk_then_silence():
                    while True:
                        yield await first.get()

                call = stub.Reduce(one_chunk_then_silence(), timeout=10)
                await call.read()  # chunk 0 of the mean: the reducer counted our chunk 0
                call.cancel()  # broken with 7 of 8 chunks unsent
                again = stub.Reduce(iter(stream), timeout=10)
                return [reply async for reply in again]

        try:
            *reports, replies = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        butterfly_allreduce(plan, p.member.peer_id, v, 1.0, o, p.registry, p.channels, timeout=6.0)
                        for p, v, o in zip(peers, values, outs)
                    ),
                    ghost_sender(),
                ),
                30,
            )
        finally:
            await stop_peers(peers)
        assert replies[-1].last and sorted(replies[-1].included) == ["peer00", "peer01"]
        mean = torch.cat([torch.frombuffer(bytearray(r.values), dtype=torch.float32) for r in replies])
        assert torch.equal(mean, outs[0][offset : offset + length])
        assert torch.equal(outs[0], outs[1])
        for report in reports:
            assert report.included_peers == ["peer00", "peer01"]

    run(main())


def test_error_feedback_bounds_the_error_of_many_rounds():
    """Averaging the same buffers round after round: with error feedback the running sum of
    results stays within one round's error of the exact sum; without it the error grows."""

    async def main():
        peers = await start_peers(3)
        gen = torch.Generator().manual_seed(11)
        values = [torch.randn(20_000, generator=gen) for _ in range(3)]
        exact = exact_mean(values, [1.0] * 3)
        residuals = [torch.zeros(20_000) for _ in range(3)]
        errors = {}
        try:
            for feedback in (False, True):
                total = torch.zeros(20_000)
                for r in range(30):
                    plan = make_plan("test-run", r, 0, [p.member for p in peers], 20_000, 256, 4096, INT8)
                    outs = [torch.empty(20_000) for _ in range(3)]
                    await asyncio.gather(
                        *(
                            butterfly_allreduce(
                                plan,
                                p.member.peer_id,
                                v,
                                1.0,
                                o,
                                p.registry,
                                p.channels,
                                10.0,
                                feedback=Feedback(res) if feedback else None,
                            )
                            for p, v, o, res in zip(peers, values, outs, residuals)
                        )
                    )
                    total += outs[0]
                errors[feedback] = rel(total / 30, exact)
        finally:
            await stop_peers(peers)
        assert errors[True] < 0.5 * errors[False], errors

    run(main())


def test_robust_mode_bounds_a_hostile_peer_scaling_its_pseudo_gradient_by_1e6():
    """5 peers, one hostile: it sends Δ x 1e6 and, as a reducer, returns the plain mean (it
    does not trim; the plain mean of this code clips its own 1e6 x Δ to twice the others'
    length, so its answer passes honest members' norm check, or is refused by it). Honest
    reducers trim: every coordinate of their parts stays within the honest range."""

    async def main():
        peers = await start_peers(5)
        gen = torch.Generator().manual_seed(5)
        honest = [torch.randn(40_000, generator=gen) for _ in range(4)]
        hostile_values = honest[0] * 1e6
        plan = make_plan("test-run", 0, 0, [p.member for p in peers], 40_000, 256, 4096, INT8)
        outs = [torch.empty(40_000) for _ in range(5)]
        values = [*honest, hostile_values]
        trims = [0.2, 0.2, 0.2, 0.2, None]
        try:
            reports = await asyncio.gather(
                *(
                    butterfly_allreduce(
                        plan, p.member.peer_id, v, 1.0, o, p.registry, p.channels, 10.0, trim_fraction=t
                    )
                    for p, v, o, t in zip(peers, values, outs, trims)
                )
            )
        finally:
            await stop_peers(peers)
        stacked = torch.stack(honest)
        low, high = stacked.min(0).values, stacked.max(0).values
        slack = 0.02 * stacked.abs().max()  # int8 coding of the result
        hostile_offset, hostile_length = plan.parts[plan.index_of("peer04")]
        trimmed = torch.ones(40_000, dtype=torch.bool)
        trimmed[hostile_offset : hostile_offset + hostile_length] = False
        for out, report in zip(outs[:4], reports[:4]):
            assert bool(((out >= low - slack) & (out <= high + slack))[trimmed].all())
            assert [p.reducer for p in report.failed_parts] in ([], ["peer04"])  # clipped, or refused
        honest_mean = stacked.mean(0)
        plain = exact_mean(values, [1.0] * 5)
        # the plain mean would move honest peers by ~1e5 times the honest mean's size; robust mode by ~1
        assert rel(plain, honest_mean) > 1e4 and max(rel(out, honest_mean) for out in outs[:4]) < 2.0

    run(main())


class _LyingReducer(pb_grpc.AveragingServicer):
    """A reducer whose answer for its part is well-formed but has a scale of 3e38: every code
    of -128 in it would decode to -inf."""

    def __init__(self, plan, part: int):
        self.plan, self.part = plan, part

    async def Reduce(self, request_iterator, context):
        async for chunk in request_iterator:
            if chunk.last:
                break
        length = self.plan.parts[self.part][1]
        answer = _chunk(self.plan, self.part, "peer-liar", 0, -torch.ones(length))
        answer.scales = torch.full((len(answer.scales) // 4,), 3e38).numpy().tobytes()
        answer.included.extend(sorted(self.plan.member_ids))
        answer.total_weight = 2.0
        yield answer


def test_a_result_whose_scale_would_decode_to_inf_is_refused():
    """Issue 31, finding 7: a result scale of 3e38 passed the checks and decoded to -inf,
    which the outer step applied. Now the member refuses that part and keeps its own values."""

    async def main():
        (honest,) = await start_peers(1)
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        liar = Member("peer-liar", f"127.0.0.1:{port}")
        plan = make_plan("test-run", 0, 0, [honest.member, liar], 8192, 64, 4096, INT8)
        pb_grpc.add_AveragingServicer_to_server(_LyingReducer(plan, plan.index_of("peer-liar")), server)
        await server.start()
        values, out = torch.randn(8192), torch.empty(8192)
        try:
            report = await butterfly_allreduce(
                plan, honest.member.peer_id, values, 1.0, out, honest.registry, honest.channels, timeout=5.0
            )
        finally:
            await server.stop(None)
            await stop_peers([honest])
        assert bool(torch.isfinite(out).all())
        assert [p.reducer for p in report.failed_parts] == ["peer-liar"]
        offset, length = plan.parts[plan.index_of("peer-liar")]
        assert torch.equal(out[offset : offset + length], values[offset : offset + length])  # its own values kept

    run(main())


def test_silent_streams_are_closed_and_the_oldest_waiting_one_makes_room():
    """Issue 31, finding 12 and issue 56, finding 9: a stream that never sends its first chunk
    held its slot until the client's own deadline (30 s later, 16 of them from one address
    shut every honest sender of that address out). Now a stream takes a slot only once its
    first chunk checks out; until then it waits in a pool where a newcomer evicts the oldest
    waiting stream, and it is ended after the first-message timeout."""
    from dtnode.peers.reduction_registry import ReductionRegistry
    from dtnode.peers.server import start_grpc_server
    from dtnode.peers.service import AveragingService, PendingStreams
    from dtnode.peers.wire import max_message_bytes

    async def main():
        service = AveragingService(
            ReductionRegistry(), "test-run", first_message_timeout=1.0, pending=PendingStreams(per_group=2, total=2)
        )
        server, port = await start_grpc_server(service, "127.0.0.1", 0, max_message_bytes(4096))
        never = asyncio.Event()

        async def silent():
            await never.wait()
            yield pb.PartChunk()  # never reached

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.AveragingStub(channel)
                first = stub.Reduce(silent(), timeout=30)
                await asyncio.sleep(0.3)  # open on the server
                later = [stub.Reduce(silent(), timeout=30) for _ in range(2)]
                statuses = await asyncio.gather(*(stream_status(call) for call in [first, *later]))
        finally:
            never.set()
            await server.stop(None)
        assert statuses[0] == grpc.StatusCode.RESOURCE_EXHAUSTED  # the oldest made room
        assert statuses[1:] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2  # ended by the server after 1 s, not 30

    run(main())


def test_a_slot_holder_on_the_senders_network_does_not_shut_the_group_out():
    """Issue 56, finding 9: 16 silent streams per host (or 8 addresses) held a node's stream slots
    for 30 s each before anything was checked, and the honest senders of that network were
    refused. Here a holder keeps 24 silent streams open to every member, from the members' own
    address, while they average: every part goes through."""

    async def main():
        peers = await start_peers(3)
        never = asyncio.Event()

        async def silent():
            await never.wait()
            yield pb.PartChunk()  # never reached

        channels = [grpc.aio.insecure_channel(p.member.grpc_addr) for p in peers]
        holders = [pb_grpc.AveragingStub(c).Reduce(silent(), timeout=60) for c in channels for _ in range(24)]
        await asyncio.sleep(0.5)  # all open on the servers
        values = [torch.randn(20_000) for _ in peers]
        try:
            outs, reports = await allreduce(peers, values, [1.0] * 3, timeout=20.0)
        finally:
            never.set()
            for call in holders:
                call.cancel()
            for c in channels:
                await c.close()
            await stop_peers(peers)
        assert all(not r.failed_parts for r in reports), [r.failed_parts for r in reports]
        assert rel(outs[0], exact_mean(values, [1.0] * 3)) <= INT8_BOUND

    run(main())


@pytest.mark.parametrize("codec,hop", [(INT8, 1), (FP32, 0), (SPARSE, 0), (SPARSE, 1)])
def test_a_mean_written_over_the_members_own_values_has_the_bits_of_one_written_beside_them(codec, hop):
    """A node's Δ buffer takes its mean back (4 bytes per parameter less than a buffer for each):
    every part's result is written over the member's values only once the whole part is in, so
    what a reducer or a stream still reads is the member's own values to the end. (int8 after
    hop 0: at hop 0 the reducer adds its own exact values in arrival order, and two runs differ
    in the last bits anyway.)"""

    async def averaged(values: list[torch.Tensor], in_place: bool) -> list[torch.Tensor]:
        peers = await start_peers(3, bandwidths=[1.0, 2.5, 1.0], client_mode=(2,))
        try:
            outs, reports = await allreduce(
                peers,
                values,
                [0.5, 1.0, 2.0],
                codec=codec,
                hop=hop,
                block_size=1024,
                chunk_elements=2048,
                top_k=64 if codec == SPARSE else 0,
                in_place=in_place,
            )
        finally:
            await stop_peers(peers)
        assert all(not r.failed_parts for r in reports)
        return outs

    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(3 * 5000 + 7, generator=gen) for _ in range(3)]
    beside = run(averaged(values, False))
    own = [v.clone() for v in values]
    over = run(averaged(own, True))
    for a, b, mine in zip(beside, over, own, strict=True):
        assert b is mine and torch.equal(a, b)


def test_a_result_refused_after_its_last_chunk_leaves_the_members_own_values_whole():
    """A re-synced θ_g that would move a member's own by more than its bound is refused when its
    last chunk is in: with the result written in place, none of its chunks may have reached the
    member's values before that."""

    async def main():
        peers = await start_peers(2)
        plan = make_plan("test-run", 0, 0, [p.member for p in peers], 9_000, 64, 1024, FP32)
        values = [torch.randn(9_000), 1000 * torch.randn(9_000)]  # far apart: each mean moves both
        bounds = [DriftBound(0.5 * float(v.norm()), 0.0, 9_000) for v in values]  # half of each one's norm
        before = [v.clone() for v in values]
        try:
            reports = await asyncio.gather(
                *(
                    butterfly_allreduce(
                        plan, p.member.peer_id, v, 1.0, v, p.registry, p.channels, timeout=5.0, drift=bound
                    )
                    for p, v, bound in zip(peers, values, bounds)
                )
            )
        finally:
            await stop_peers(peers)
        # the small member refuses both parts (the large one's values move less than half their norm)
        assert len(reports[0].failed_parts) == 2, reports[0]
        assert all("DRIFTED" in p.error or "move our values" in p.error for p in reports[0].failed_parts)
        assert torch.equal(values[0], before[0])

    run(main())


def test_a_live_member_that_formed_no_group_is_not_waited_for_and_its_part_has_a_stand_in():
    """A member that registered and then went silent (alive: its server answers, dials
    succeed) cost its group the whole all-reduce deadline, a reducer waiting for its stream and
    a sender for its part. Its missing `formed` record tells its group-mates it is not in the
    group (peers/presence.py): they drop it from their parts and stop asking for its part. Its
    part then goes to its stand-in, the next reducer of the plan (peers/stand_in.py): before,
    each member kept its own values there and the two left the group with different values."""

    async def main():
        peers = await start_peers(3)
        silent = peers[2].member.peer_id  # its server is up; it never joins this all-reduce
        plan = make_plan("test-run", 0, 0, [p.member for p in peers], 9_000, 64, 1024, INT8)
        values = [torch.randn(9_000) for _ in range(2)]
        outs = [torch.empty(9_000) for _ in range(2)]

        async def absent(forming):
            return {silent}

        started = time.monotonic()
        try:
            reports = await asyncio.gather(
                *(
                    butterfly_allreduce(
                        plan, p.member.peer_id, v, 1.0, o, p.registry, p.channels, timeout=60.0, absent=absent
                    )
                    for p, v, o in zip(peers[:2], values, outs)
                )
            )
        finally:
            await stop_peers(peers)
        assert time.monotonic() - started < 10  # the deadline was 60 s (48 s for the reducers)
        for report in reports:
            assert report.included_peers == ["peer00", "peer01"]
            assert not report.failed_parts
            assert [p.stood_in_for for p in report.parts if p.stood_in_for] == [silent]
        assert torch.equal(outs[0], outs[1])
        assert rel(outs[0], exact_mean(values, [1.0, 1.0])) <= INT8_BOUND

    run(main())


async def _one_mistaken_reader(late: int, delay: float) -> tuple[list[str], list, list[torch.Tensor], list]:
    """Three members in one int8 all-reduce; peer 0's reads of the `formed` records never see
    peer 1's (it takes it for absent), and peer `late` starts `delay` seconds after the others:
    (ids, reports, values, the members' all-reduces)."""
    peers = await start_peers(3)
    ids = [p.member.peer_id for p in peers]
    plan = make_plan("test-run", 0, 0, [p.member for p in peers], 9_000, 64, 1024, INT8)
    values = [torch.randn(9_000) for _ in range(3)]
    outs = [torch.empty(9_000) for _ in range(3)]

    async def mistaken(forming):
        return {ids[1]}

    async def nobody(forming):
        return set()

    runs = [
        ButterflyAllReduce(
            plan,
            ids[i],
            values[i],
            1.0,
            outs[i],
            peers[i].registry,
            peers[i].channels,
            60.0,
            absent=mistaken if i == 0 else nobody,
        )
        for i in range(3)
    ]

    async def one(i: int):
        if i == late:
            await asyncio.sleep(delay)
        return await runs[i].run()

    try:
        reports = await asyncio.gather(*(one(i) for i in range(3)))
    finally:
        await stop_peers(peers)
    return ids, reports, values, runs


def test_a_member_taken_for_absent_by_one_group_mate_is_told_so_and_neither_waits_for_the_other():
    """Presence is read from a lagging DHT: one member may take a present one for absent. It then
    leaves it out of its part and stops streaming to it, while the other (which read every record)
    waited for its stream to the deadline: 48 s in a hop 0 of 32 nodes on 2 cores, and came late to
    every group of the next hop. Now its stream is answered NOT_FOUND, and it leaves the first out
    of its own part at once: the two lack each other's values in their two parts, and nobody waits."""

    async def main():
        started = time.monotonic()
        # peer 1 comes after peer 0's first probe (PROBE_AFTER_S): nothing says it is present
        ids, reports, _, _ = await _one_mistaken_reader(late=1, delay=1.5)
        assert time.monotonic() - started < 15  # the reducers' deadline was 48 s
        assert [p.reducer for p in reports[0].failed_parts] == [ids[1]]
        assert [(p.reducer, p.error.split(":")[0]) for p in reports[1].failed_parts] == [(ids[0], "NOT_FOUND")]
        assert reports[2].failed_parts == []
        part = {o.reducer: o for o in reports[2].parts}
        assert part[ids[0]].included == [ids[0], ids[2]] and part[ids[1]].included == [ids[1], ids[2]]
        assert part[ids[2]].included == ids

    run(main())


def test_a_member_that_took_our_stream_is_present_whatever_the_records_say():
    """A reducer that took this member's stream into its part formed this group (it says so at
    once, `REDUCING_METADATA`), and a sender whose stream began did too: a `formed` record read
    late (a loaded host's DHT) no longer makes either absent. Here peer 0's reads never see peer
    1's record, and the group waits 2 s for a slow third member: before, peer 0 took peer 1 for
    absent half a second in, and the two parts between them lacked each other's values."""

    async def main():
        ids, reports, values, runs = await _one_mistaken_reader(late=2, delay=2.0)
        for report in reports:
            assert report.failed_parts == [] and report.included_peers == ids
        assert rel(runs[0].out, exact_mean(values, [1.0] * 3)) <= INT8_BOUND
        assert runs[0].present == {ids[1], ids[2]}  # both reducers said they took peer 0's stream

    run(main())


def test_a_parts_stand_in_is_the_next_reducer_of_the_plan_around_and_none_for_a_lone_reducer():
    members = [Member("a", "x:1"), Member("b", "", client_mode=True), Member("c", "x:3"), Member("d", "x:4")]
    plan = make_plan("test-run", 0, 0, members, 9_000, 64, 1024, INT8)
    ids = plan.member_ids
    reducers = [i for i, (_, length) in enumerate(plan.parts) if length > 0]
    assert len(reducers) == 3 and ids[plan.member_ids.index("b")] == "b"
    for k, part in enumerate(reducers):
        assert stand_in(plan, part) is plan.members[reducers[(k + 1) % 3]]  # client-mode members reduce nothing
    lone = make_plan("test-run", 0, 0, [Member("a", "x:1"), Member("b", "", client_mode=True)], 900, 64, 1024, INT8)
    (only,) = [i for i, (_, length) in enumerate(lone.parts) if length > 0]
    assert stand_in(lone, only) is None
