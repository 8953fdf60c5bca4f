"""Sparse pseudo-gradients: the top-k codec, its error feedback, its wire validation, and the
butterfly averaging sparse payloads on real loopback gRPC servers."""

import asyncio

import grpc
import pytest
import torch
from allreduce_harness import allreduce, allreduce_beside, send_to_each_reducer, start_peers, stop_peers
from path_tampering import FlippingProxy

from dtnode.ops import positions, sparse
from dtnode.peers.averager import AveragingConfig, as_a_group_of_one
from dtnode.peers.butterfly import butterfly_allreduce
from dtnode.peers.matchmaking import FormedGroup
from dtnode.peers.part_codec import Feedback
from dtnode.peers.plan import SPARSE, Compression, Member, WireFormat, make_plan
from dtnode.peers.wire import ChunkError, RefusalReason, chunk_message, decode_chunk

BLOCK, K = 4096, 64


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_codec_keeps_the_k_largest_of_every_block_with_two_bit_values():
    x = torch.randn(3 * BLOCK + 1000, generator=torch.Generator().manual_seed(0))
    payload = sparse.encode(x, BLOCK, K)
    assert payload.counts.tolist() == [K, K, K, K]
    decoded = sparse.decode(payload)
    for b in range(4):
        block = x[b * BLOCK : (b + 1) * BLOCK]
        kept = set((decoded[b * BLOCK : (b + 1) * BLOCK] != 0).nonzero().squeeze(1).tolist())
        assert kept == set(block.abs().topk(K).indices.tolist())
    where = sparse.positions(payload)
    assert torch.equal(torch.sign(decoded[where]), torch.sign(x[where]))
    for b in range(4):  # two magnitudes per block: its low and high means
        in_block = where[(where >= b * BLOCK) & (where < (b + 1) * BLOCK)]
        assert decoded[in_block].abs().unique().numel() <= 2
    assert sparse.wire_bytes(payload) / x.numel() < 0.027  # Elias-Fano positions and 2-bit values
    assert sparse.bytes_per_value(BLOCK, K) < 0.022  # in full blocks: 8 bits a position, 2 a value
    # a shorter last block than k keeps all of its values
    short = sparse.encode(torch.randn(BLOCK + 10), BLOCK, K)
    assert short.counts.tolist() == [K, 10]


def test_packed_positions_and_codes_round_trip():
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([BLOCK, BLOCK, BLOCK, BLOCK, BLOCK, 100, 1])
    counts = torch.tensor([K, 0, 1, BLOCK, 700, 100, 1])  # top-k, empty, lone, full, a union, short
    indices = torch.cat(
        [torch.randperm(int(n), generator=gen)[: int(c)].sort().values for c, n in zip(counts, lengths, strict=True)]
    )
    packed = positions.pack_positions(indices, counts, lengths)
    assert packed.numel() == positions.packed_position_bytes(counts, lengths)
    assert torch.equal(positions.unpack_positions(packed, counts, lengths), indices)
    # 8 bits a position for 64 of 4,096 (12 as fixed-width), about 6 for a group of 4's union
    assert positions.position_bits_per_block(K, BLOCK) == 8 * K
    assert positions.position_bits_per_block(4 * K - 20, BLOCK) / (4 * K - 20) < 6.2
    codes = torch.randint(0, 4, (1003,), dtype=torch.int8)
    assert torch.equal(sparse.unpack_two_bit(sparse.pack_two_bit(codes), 1003), codes)


def test_error_feedback_makes_the_sum_of_what_is_sent_follow_the_sum_of_the_deltas():
    """Pseudo-gradients share a direction round to round; what top-k drops of it waits in the
    buffer and goes out later, so the running sum of what was sent converges to that of the
    Δs. Without feedback ~98% of every Δ is lost for good."""
    gen = torch.Generator().manual_seed(1)
    direction = torch.randn(8 * BLOCK, generator=gen)
    residual = torch.zeros(8 * BLOCK)
    sent, total, plain = torch.zeros(8 * BLOCK), torch.zeros(8 * BLOCK), torch.zeros(8 * BLOCK)
    errors = []
    for r in range(1, 201):
        delta = direction + torch.randn(8 * BLOCK, generator=gen)
        total += delta
        sent += sparse.decode(sparse.encode_with_feedback(delta, residual, BLOCK, K))
        plain += sparse.decode(sparse.encode(delta, BLOCK, K))
        torch.testing.assert_close(sent + residual, total, rtol=0, atol=1e-3)  # nothing is lost
        if r in (20, 200):
            errors.append(rel(sent, total))
    assert errors[1] < 0.5 * errors[0], errors
    assert errors[1] < 0.15, errors
    assert rel(plain, total) > 0.8


def test_the_mean_of_sparse_payloads_is_returned_on_its_support():
    x = torch.zeros(2 * BLOCK + 7)
    x[[3, 17, BLOCK + 5, 2 * BLOCK + 6]] = torch.tensor([0.5, -0.25, 1e-3, 2.0])
    payload = sparse.encode_support(x, BLOCK)
    assert payload.counts.tolist() == [2, 1, 1]
    torch.testing.assert_close(sparse.decode(payload), x, rtol=0.01, atol=0)


# ---- wire ---------------------------------------------------------------------------------
def _plan(members=("a", "b", "c")):
    return make_plan("run", 0, 0, [Member(m, "") for m in members], 4 * BLOCK, BLOCK, 2 * BLOCK, SPARSE, top_k=K)


def _chunk(plan):
    """An honest chunk of a full block and a short one of 100 values."""
    return chunk_message(plan, 0, "b", 1.0, 0, sparse.encode(torch.randn(BLOCK + 100), BLOCK, K))


def _with_indices(chunk, change):
    """Re-code the chunk's positions after `change`: any non-decreasing high parts can be coded,
    so a sender can send positions out of range, repeated or (inside a bucket) out of order."""
    lengths = sparse.block_lengths(chunk.length, BLOCK)
    counts = lengths.clamp_max(K)
    packed = torch.frombuffer(bytearray(chunk.indices), dtype=torch.uint8)
    indices = positions.unpack_positions(packed, counts, lengths)
    change(indices)
    chunk.indices = positions.pack_positions(indices, counts, lengths).numpy().tobytes()


def _with_position_bits(chunk, change):
    """Edit the chunk's position bits themselves (least significant bit of each byte first)."""
    packed = torch.frombuffer(bytearray(chunk.indices), dtype=torch.uint8)
    bits = ((packed.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)
    change(bits)
    chunk.indices = (bits.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8).numpy().tobytes()


# the honest chunk's position bits: block 0 (64 of 4,096) has 6 low bits a position and a high
# bitvector of 64 + 63 + 1 bits; the short block (64 of 100) no low bits and 64 + 99 + 1 bits
LOW_BITS, HIGH_BITS_0, HIGH_BITS_1 = 6 * K, 2 * K, K + 100


def _last_high_bit_of_block_0_moved_on(bits):
    high_0, high_1 = LOW_BITS, LOW_BITS + HIGH_BITS_0
    bits[high_0 + int(bits[high_0:high_1].nonzero().max())] = 0
    bits[high_1 + int((bits[high_1 : high_1 + HIGH_BITS_1] == 0).nonzero()[0])] = 1


def _bucket_mates_swapped(i):
    """The first two positions of block 0, both in the second's bucket, the larger first."""
    bucket = int(i[1]) >> 6  # 6 low bits for 64 of 4,096
    i[0], i[1] = (bucket << 6) | 63, bucket << 6


def _with_scales(chunk, value):
    scales = torch.frombuffer(bytearray(chunk.scales), dtype=torch.float32).clone()
    scales[1] = value
    chunk.scales = scales.numpy().tobytes()


MALFORMED = {
    "position outside its block": (
        lambda c: _with_indices(c, lambda i: i.__setitem__(-1, 100)),  # the short block has 100
        RefusalReason.INDEX_OUT_OF_RANGE,
    ),
    "duplicate position": (lambda c: _with_indices(c, lambda i: i.__setitem__(1, i[0])), RefusalReason.DUPLICATE_INDEX),
    "positions out of order": (lambda c: _with_indices(c, _bucket_mates_swapped), RefusalReason.DUPLICATE_INDEX),
    "a block's positions one too many": (
        lambda c: _with_position_bits(c, lambda b: b.__setitem__(LOW_BITS + HIGH_BITS_0 - 1, 1)),  # never set honestly
        RefusalReason.WRONG_COUNT,
    ),
    "a position moved into the next block": (
        lambda c: _with_position_bits(c, _last_high_bit_of_block_0_moved_on),
        RefusalReason.WRONG_COUNT,
    ),
    "stray padding bits": (lambda c: _with_position_bits(c, lambda b: b.__setitem__(-1, 1)), RefusalReason.WRONG_COUNT),
    "a block with fewer values": (
        lambda c: c.__setattr__("counts", torch.tensor([K - 1, K], dtype=torch.int16).numpy().tobytes()),
        RefusalReason.WRONG_COUNT,
    ),
    "another top_k": (lambda c: c.__setattr__("top_k", 2 * K), RefusalReason.WRONG_COUNT),
    "missing positions": (lambda c: c.__setattr__("indices", c.indices[:-3]), RefusalReason.WRONG_COUNT),
    "missing codes": (lambda c: c.__setattr__("values", c.values[:-1]), RefusalReason.WRONG_COUNT),
    "NaN scale": (lambda c: _with_scales(c, float("nan")), RefusalReason.BAD_SCALE),
    "infinite scale": (lambda c: _with_scales(c, float("inf")), RefusalReason.BAD_SCALE),
    "negative scale": (lambda c: _with_scales(c, -1.0), RefusalReason.BAD_SCALE),
}


@pytest.mark.parametrize("attack", sorted(MALFORMED))
def test_a_malformed_sparse_chunk_is_refused_with_its_reason(attack):
    plan = _plan()
    chunk = _chunk(plan)
    decode_chunk(chunk, plan, 2 * BLOCK, 0)  # the honest chunk passes
    change, reason = MALFORMED[attack]
    change(chunk)
    with pytest.raises(ChunkError) as refused:
        decode_chunk(chunk, plan, 2 * BLOCK, 0)
    assert refused.value.reason == reason


def test_a_result_may_not_hold_more_values_per_block_than_all_members_kept():
    plan = _plan(("a", "b"))
    dense = torch.randn(2 * BLOCK)
    result = chunk_message(plan, 0, "a", 0.0, 0, sparse.encode_support(dense, BLOCK), result=True)
    with pytest.raises(ChunkError) as refused:
        decode_chunk(result, plan, 2 * BLOCK, 0, result=True)
    assert refused.value.reason == RefusalReason.WRONG_COUNT
    dense[dense.abs() < 2.4] = 0  # about 1.6% of the values: within two members' 2 x 64
    decoded = decode_chunk(
        chunk_message(plan, 0, "a", 0.0, 0, sparse.encode_support(dense, BLOCK), result=True),
        plan,
        2 * BLOCK,
        0,
        result=True,
    )
    torch.testing.assert_close(sparse.decode(decoded), dense, rtol=0.01, atol=0)


# ---- the data plane -----------------------------------------------------------------------
def test_sparse_allreduce_gives_every_member_the_same_mean_of_what_the_members_kept():
    async def main():
        peers = await start_peers(3, chunk_elements=2 * BLOCK)
        gen = torch.Generator().manual_seed(3)
        numel = 5 * BLOCK + 123
        values = [torch.randn(numel, generator=gen) for _ in range(3)]
        weights = [100.0, 200.0, 300.0]
        try:
            outs, reports = await allreduce(
                peers, values, weights, block_size=BLOCK, chunk_elements=2 * BLOCK, codec=SPARSE, top_k=K
            )
        finally:
            await stop_peers(peers)
        kept = [sparse.decode(sparse.encode(v, BLOCK, K)) for v in values]
        expected = sum(w * k for w, k in zip(weights, kept)) / sum(weights)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])  # bit for bit
        assert rel(outs[0], expected) < 0.01  # the int8 code of the returned mean
        assert set(outs[0].nonzero().squeeze(1).tolist()) == set(expected.nonzero().squeeze(1).tolist())
        for report in reports:
            assert not report.failed_parts
            assert report.included_peers == ["peer00", "peer01", "peer02"]
            assert report.bytes_sent < 0.2 * numel  # int8 would send ~0.7 bytes per value here

    asyncio.run(main())


def test_moshpit_groups_of_two_reach_the_mean_one_group_of_four_would():
    """Hop 1's values are pair means, sparse on up to 2 x 64 positions per block: they travel on
    their support with 8-bit values, so two hops of pairs end with what one group of 4 returns
    (the mean of every member's top-k), not a top-k cut of it. With error feedback nothing is
    lost: what was applied and what the members owe add up to the mean of their Δs."""

    async def main():
        peers = await start_peers(4, chunk_elements=2 * BLOCK)
        gen = torch.Generator().manual_seed(5)
        numel = 3 * BLOCK + 77
        values = [torch.randn(numel, generator=gen) for _ in range(4)]
        weights = [1.0, 2.0, 3.0, 4.0]
        buffers = [torch.zeros(numel) for _ in range(4)]
        feedback = [Feedback(b) for b in buffers]
        common = {"block_size": BLOCK, "chunk_elements": 2 * BLOCK, "codec": SPARSE, "top_k": K}
        try:
            pairs: list[torch.Tensor | None] = [None] * 4
            for group in ((0, 1), (2, 3)):
                outs, _ = await allreduce(
                    [peers[i] for i in group],
                    [values[i] for i in group],
                    [weights[i] for i in group],
                    feedback=[feedback[i] for i in group],
                    **common,
                )
                for i, out in zip(group, outs):
                    pairs[i] = out
            later = [Feedback(b, inject=False) for b in buffers]
            final: list[torch.Tensor | None] = [None] * 4
            for group in ((0, 2), (1, 3)):
                pair_weights = [weights[0] + weights[1], weights[2] + weights[3]]
                outs, reports = await allreduce(
                    [peers[i] for i in group],
                    [pairs[i] for i in group],
                    pair_weights,
                    hop=1,
                    feedback=[later[i] for i in group],
                    **common,
                )
                assert not any(r.failed_parts for r in reports)
                assert all(r.bytes_sent < 0.15 * numel for r in reports)  # still sparse
                for i, out in zip(group, outs):
                    final[i] = out
        finally:
            await stop_peers(peers)
        kept = [sparse.decode(sparse.encode(v, BLOCK, K)) for v in values]
        one_group = sum(w * k for w, k in zip(weights, kept)) / sum(weights)
        assert torch.equal(final[0], final[2]) and torch.equal(final[1], final[3])
        # the two groups of hop 1 reduced the same two pair means: all four apply the same bits
        assert torch.equal(final[0], final[1])
        assert rel(final[0], one_group) < 0.02  # int8 codes of means, twice; a top-k cut would lose ~half
        assert rel(final[1], one_group) < 0.02
        owed = sum(w * b for w, b in zip(weights, buffers)) / sum(weights)
        exact = sum(w * v for w, v in zip(weights, values)) / sum(weights)
        assert rel(final[0] + owed, exact) < 0.01  # nothing lost but the int8 rounding of the returned means

    asyncio.run(main())


def test_a_member_alone_with_a_groups_mean_applies_what_a_group_holding_that_mean_returns():
    """A group of 3 in hop 1 returns up to 3 x 2k values per block; whoever carries that mean
    into a group of hop 2 sends its 2k largest. A class-mate alone in hop 2 (views differ) used
    to keep the whole mean, and its θ_g left the others' (a 6-peer swarm in pairs split about one
    round in six). Alone, it now goes through the same butterfly as a group of one: the bits a
    pair holding that mean returns, and the same cut in its buffer."""

    async def main():
        peers = await start_peers(6, chunk_elements=2 * BLOCK)
        gen = torch.Generator().manual_seed(11)
        numel = 3 * BLOCK + 77
        common = {"block_size": BLOCK, "chunk_elements": 2 * BLOCK, "codec": SPARSE, "top_k": K}
        config = AveragingConfig(
            "test-run", "m", 2, wire=WireFormat(Compression.SPARSE, BLOCK, K), chunk_elements=2 * BLOCK
        )
        try:
            inputs = [torch.randn(numel, generator=gen) for _ in range(3)]
            means, _ = await allreduce(peers[:3], inputs, [1.0, 2.0, 3.0], hop=1, **common)
            mean = means[0]
            pair_buffers = [torch.zeros(numel) for _ in range(2)]
            pair, reports = await allreduce(
                peers[3:5],
                [mean.clone(), mean.clone()],
                [3.0, 3.0],
                round=1,
                hop=2,
                feedback=[Feedback(b, inject=False) for b in pair_buffers],
                **common,
            )
            lone_buffer, lone = torch.zeros(numel), torch.empty(numel)
            alone = FormedGroup("d3.0-1", [peers[5].member], 1, 0.0, complete=True)
            report = await as_a_group_of_one(
                config,
                1,
                2,
                alone,
                mean.clone(),
                6.0,
                lone,
                Feedback(lone_buffer, inject=False),
                peers[5].registry,
                peers[5].channels,
            )
        finally:
            await stop_peers(peers)
        kept_per_block = [int((mean[b * BLOCK : (b + 1) * BLOCK] != 0).sum()) for b in range(3)]
        assert min(kept_per_block) > 2 * K  # the test meets the cut
        assert not any(r.failed_parts for r in reports) and not report.failed_parts
        assert torch.equal(pair[0], pair[1]) and torch.equal(lone, pair[0])  # bit for bit
        assert not torch.equal(lone, mean)  # kept whole, as before, it would differ
        assert torch.equal(lone_buffer, pair_buffers[0])  # the same cut, owed in the next Δ
        torch.testing.assert_close(lone + lone_buffer, mean, rtol=0, atol=1e-6)  # nothing lost
        assert report.weight_after(6.0) == 6.0 and report.included_peers == [peers[5].member.peer_id]
        assert report.bytes_sent == report.bytes_received == 0  # a group of one streams nothing

    asyncio.run(main())


def test_a_later_hop_sends_at_most_twice_top_k_eight_bit_values_per_block():
    plan = make_plan("run", 0, 1, [Member(m, "") for m in "ab"], 2 * BLOCK, BLOCK, 2 * BLOCK, SPARSE, top_k=K)
    assert plan.sender_top_k == 2 * K
    mean = torch.zeros(2 * BLOCK)
    gen = torch.Generator().manual_seed(5)  # 300 values over two blocks: at least 2 x 64 in each
    mean[torch.randperm(2 * BLOCK, generator=gen)[:300]] = torch.randn(300, generator=gen)
    payload = sparse.encode_mean(mean, BLOCK, plan.sender_top_k)
    assert payload.counts.tolist() == [2 * K, 2 * K] and payload.value_bits == sparse.EIGHT_BIT
    decoded = decode_chunk(chunk_message(plan, 0, "b", 1.0, 0, payload), plan, 2 * BLOCK, 0)
    assert torch.equal(sparse.decode(decoded), sparse.decode(payload))
    few = torch.zeros(2 * BLOCK)
    few[[5, 9, BLOCK + 1]] = torch.tensor([1.0, -0.5, 0.25])
    small = sparse.encode_mean(few, BLOCK, plan.sender_top_k)  # fewer nonzeros than k: just those
    assert small.counts.tolist() == [2, 1]
    torch.testing.assert_close(sparse.decode(small), few, rtol=0.01, atol=0)
    too_many = sparse.encode_mean(torch.randn(2 * BLOCK), BLOCK, 3 * K)
    with pytest.raises(ChunkError) as refused:
        decode_chunk(chunk_message(plan, 0, "b", 1.0, 0, too_many), plan, 2 * BLOCK, 0)
    assert refused.value.reason == RefusalReason.WRONG_COUNT
    two_bit = sparse.encode(torch.randn(2 * BLOCK), BLOCK, K)  # hop 0's code is not a later hop's
    with pytest.raises(ChunkError):
        decode_chunk(chunk_message(plan, 0, "b", 1.0, 0, two_bit), plan, 2 * BLOCK, 0)


def test_sparse_allreduce_with_error_feedback_loses_nothing_and_closes_in_on_the_exact_mean():
    async def main():
        peers = await start_peers(3, chunk_elements=2 * BLOCK)
        gen = torch.Generator().manual_seed(4)
        numel = 4 * BLOCK
        directions = [torch.randn(numel, generator=gen) for _ in range(3)]
        buffers = [torch.zeros(numel) for _ in range(3)]
        applied, exact = torch.zeros(numel), torch.zeros(numel)
        errors = []
        try:
            for r in range(40):
                values = [d + torch.randn(numel, generator=gen) for d in directions]
                outs, _ = await allreduce(
                    peers,
                    values,
                    [1.0] * 3,
                    round=r,
                    block_size=BLOCK,
                    chunk_elements=2 * BLOCK,
                    codec=SPARSE,
                    top_k=K,
                    feedback=[Feedback(b) for b in buffers],
                )
                applied += outs[0]
                exact += sum(values) / 3
                # nothing is lost: what was applied and what the members still owe make up the exact sum
                assert rel(applied + sum(buffers) / 3, exact) < 0.01
                if r + 1 in (10, 40):
                    errors.append(rel(applied, exact))
        finally:
            await stop_peers(peers)
        assert errors[1] < 0.75 * errors[0], errors

    asyncio.run(main())


def test_a_hostile_sparse_sender_is_refused_counted_by_reason_and_leaves_the_mean_alone():
    async def main():
        peers = await start_peers(2, chunk_elements=2 * BLOCK)
        hostile = Member("peer-hostile", "", client_mode=True)
        numel = 2 * BLOCK
        plan = make_plan(
            "test-run", 5, 0, [*(p.member for p in peers), hostile], numel, BLOCK, 2 * BLOCK, SPARSE, top_k=K
        )
        values = [torch.randn(numel) for _ in range(2)]
        outs = [torch.empty(numel) for _ in range(2)]

        def duplicate_position(part, length):
            chunk = chunk_message(plan, part, "peer-hostile", 1.0, 0, sparse.encode(torch.randn(length), BLOCK, K))
            chunk.last = True
            _with_indices(chunk, lambda i: i.__setitem__(1, i[0]))
            return chunk

        try:
            attacker = send_to_each_reducer(plan, peers, duplicate_position)
            reports, codes = await allreduce_beside(plan, peers, values, outs, attacker)
        finally:
            await stop_peers(peers)
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 2
        kept = [sparse.decode(sparse.encode(v, BLOCK, K)) for v in values]
        assert rel(outs[0], (kept[0] + kept[1]) / 2) < 0.01
        assert torch.equal(outs[0], outs[1])
        for peer, report in zip(peers, reports):
            assert "peer-hostile" not in report.included_peers
            assert peer.service.refused == {RefusalReason.DUPLICATE_INDEX: 1}

    asyncio.run(main())


def test_sparse_over_tls_with_a_client_mode_member_gives_everyone_the_same_mean():
    async def main():
        peers = await start_peers(3, tls=True, client_mode=(2,), chunk_elements=2 * BLOCK)
        values = [torch.randn(6 * BLOCK) for _ in range(3)]
        try:
            outs, reports = await allreduce(
                peers, values, [1.0, 2.0, 3.0], block_size=BLOCK, chunk_elements=2 * BLOCK, codec=SPARSE, top_k=K
            )
        finally:
            await stop_peers(peers)
        kept = [sparse.decode(sparse.encode(v, BLOCK, K)) for v in values]
        assert rel(outs[0], (kept[0] + 2 * kept[1] + 3 * kept[2]) / 6) < 0.01
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
        assert all(not r.failed_parts for r in reports)

    asyncio.run(main())


def test_a_dead_reducer_leaves_a_sparse_member_its_own_values_and_nothing_owed_there():
    """The part nobody could average (its reducer and its stand-in, peers/stand_in.py, are both
    dead) is applied from the member's own Δ and what it owed, exactly as int8 keeps its own
    values; the other parts, the one a stand-in averaged included, keep what top-k did not send
    in the buffer."""

    async def main():
        peers = await start_peers(2, chunk_elements=2 * BLOCK)
        dead = [Member("peer98", "127.0.0.1:1"), Member("peer99", "127.0.0.1:1")]  # nobody listens there
        members = [p.member for p in peers] + dead
        numel = 8 * BLOCK
        plan = make_plan("test-run", 0, 0, members, numel, BLOCK, 2 * BLOCK, SPARSE, top_k=K)
        values = [torch.randn(numel) for _ in range(2)]
        owed = [torch.randn(numel) * 0.1 for _ in range(2)]
        buffers = [o.clone() for o in owed]
        outs = [torch.empty(numel) for _ in range(2)]
        try:
            await asyncio.gather(
                *(
                    butterfly_allreduce(
                        plan, p.member.peer_id, v, 1.0, o, p.registry, p.channels, 3.0, feedback=Feedback(b)
                    )
                    for p, v, o, b in zip(peers, values, outs, buffers)
                )
            )
        finally:
            await stop_peers(peers)
        offset, length = plan.parts[plan.index_of("peer98")]  # its stand-in, peer99, is dead too
        dead = slice(offset, offset + length)
        for v, o, before, after in zip(values, outs, owed, buffers):
            torch.testing.assert_close(o[dead], v[dead] + before[dead])
            assert not after[dead].any()
        live = torch.ones(numel, dtype=torch.bool)
        live[dead] = False
        exact = (values[0] + owed[0] + values[1] + owed[1]) / 2
        assert rel(outs[0][live] + (buffers[0][live] + buffers[1][live]) / 2, exact[live]) < 0.01  # nothing lost

    asyncio.run(main())


def test_a_sparse_stream_broken_on_the_path_is_sent_again_from_the_same_feedback():
    """A flipped byte breaks the TLS stream; it is sent again, encoded again from the buffer as
    it was before the first try, so nothing is sent twice or lost."""

    async def main():
        peers = await start_peers(2, tls=True, chunk_elements=128 * BLOCK)  # a part in one chunk of ~16 kB
        port = int(peers[0].member.grpc_addr.rsplit(":", 1)[1])
        proxy = FlippingProxy(port, offset=6_000)  # past the handshake, inside the first chunk
        proxy_port = await proxy.start()
        via_proxy = [Member(peers[0].member.peer_id, f"127.0.0.1:{proxy_port}"), peers[1].member]
        numel = 256 * BLOCK
        values = [torch.randn(numel) for _ in range(2)]
        buffers = [torch.zeros(numel) for _ in range(2)]
        try:
            outs, reports = await allreduce(
                peers,
                values,
                [1.0, 1.0],
                block_size=BLOCK,
                chunk_elements=128 * BLOCK,
                codec=SPARSE,
                top_k=K,
                timeout=10.0,
                members=via_proxy,
                feedback=[Feedback(b) for b in buffers],
            )
        finally:
            proxy.server.close()
            await stop_peers(peers)
        assert proxy.flipped
        assert len(reports[1].retried) == 1, reports[1]
        assert not reports[0].failed_parts and not reports[1].failed_parts
        assert torch.equal(outs[0], outs[1])
        exact = (values[0] + values[1]) / 2
        assert rel(outs[0] + (buffers[0] + buffers[1]) / 2, exact) < 0.01

    asyncio.run(main())
