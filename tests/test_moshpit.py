"""Moshpit grid and matchmaking: exact mean on full grids, agreement without a leader."""

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from dht_harness import ready_dht
from hivemind.utils import get_dht_time
from pydantic import ValidationError

from dtnode.ops.ordered_mean import ordered_weighted_mean, sum_weights
from dtnode.ops.quantization import dequantize, quantize
from dtnode.peers import matchmaking
from dtnode.peers.absentees import BENCH_ROUNDS
from dtnode.peers.auth import AuthError
from dtnode.peers.averager import AveragingConfig, AveragingTimeout, MoshpitAverager, within_bound
from dtnode.peers.deadlines import AdaptiveDeadlines, expected_payload_bytes
from dtnode.peers.expectations import GroupExpectations
from dtnode.peers.grid import (
    Slot,
    agreed_dims,
    cells,
    classes_of,
    coordinates,
    first_slot,
    grid_shape,
    hop_key,
    next_slots,
    split_groups,
)
from dtnode.peers.group_reduce import group_load
from dtnode.peers.leadership import by_rank
from dtnode.peers.matchmaking import Matchmaker, Registration
from dtnode.peers.membership import PeerRecord
from dtnode.peers.plan import Compression, Member, WireFormat


@pytest.mark.parametrize(
    "n,m,d",
    [(9, 3, 2), (16, 4, 2), (24, 4, 2), (32, 4, 2), (33, 4, 3), (64, 4, 3), (129, 4, 4), (8, 2, 2), (9, 2, 3)]
    + [(4, 4, 1), (5, 4, 2), (5, 16, 1), (17, 16, 2)],
)
def test_grid_shape_fills_its_cells_with_up_to_two_groups(n, m, d):
    """The fewest hops whose hop-0 cells hold at most 2M peers on average; one group only up to M."""
    assert grid_shape(n, m) == (m, d)
    if d > 1:
        assert n <= 2 * m**d and (d == 2 or n > 2 * m ** (d - 1))


@pytest.mark.parametrize(
    "n,published,d",
    [
        (24, [], 2),  # no peer averaged yet: this node's own grid
        (24, [3] * 10 + [2] * 3, 3),  # the swarm's grid while it fits
        (40, [2] * 20, 2),  # a swarm grown past 2M^2 keeps its two hops up to 4M^2 peers
        (65, [2] * 20, 3),  # and moves on past it
        (12, [3] * 20, 3),  # a shrunk one keeps three hops down to M^2 / 2 peers
        (8, [3] * 20, 2),
        (24, [3] * 5 + [2] * 5, 2),  # no strict majority: its own
        (24, [7] * 4 + [0] * 20, 2),  # out of band, however many say it; zeros (none yet) do not vote
        (4, [2] * 20, 1),  # a swarm that fits one group is one group, whatever its records say
    ],
)
def test_a_node_takes_the_grid_most_of_its_peers_used_while_it_fits(n, published, d):
    assert agreed_dims(n, 4, published) == d


def _exact_mean(brought: list[tuple[float, torch.Tensor]]) -> tuple[torch.Tensor, float]:
    total = sum(w for w, _ in brought)
    return sum(w * v for w, v in brought) / total, total


def _reducers_mean(brought: list[tuple[float, torch.Tensor]]) -> tuple[torch.Tensor, float]:
    """What a reducer of an int8 hop computes from the rows it holds: their mean in a fixed
    order, through the int8 code; a peer alone in its group keeps its values as they are."""
    if len(brought) == 1:
        return brought[0][1], brought[0][0]
    weights = [w for w, _ in brought]
    out = torch.empty_like(brought[0][1])
    ordered_weighted_mean(torch.stack([v for _, v in brought]), weights, out=out)
    return dequantize(quantize(out)), sum_weights(weights)


def _average_over_grid(
    ids: list[str],
    step: int,
    side: int,
    dims: int,
    target: int,
    values: dict,
    weights: dict,
    mean_of: Callable[[list[tuple[float, torch.Tensor]]], tuple[torch.Tensor, float]] = _exact_mean,
):
    """Run the grid's hops as the averager does, every group forming exactly as planned: each
    peer carries a (mean, weight) pair per slot, and every group's result goes on in every
    class its member stands for; the peer's own result is its first slot's."""
    chains = {p: [(first_slot(coordinates(p, step, side, dims)), values[p], weights[p])] for p in ids}
    for hop in range(dims):
        by_key: dict[str, dict[str, int]] = {}
        for p, own in chains.items():
            for i, (slot, _, _) in enumerate(own):
                by_key.setdefault(slot.key, {})[p] = i
        results = {}
        for joined in by_key.values():
            for group in split_groups(joined, target) if hop == 0 else [sorted(joined)]:
                brought = [chains[p][joined[p]] for p in group]
                mean, total = mean_of([(w * slot.share, v) for slot, v, w in brought])
                for p in group:
                    results[p, joined[p]] = (mean, total, group)
        for p, own in chains.items():
            after = [(slot, *results[p, i][:2]) for i, (slot, _, _) in enumerate(own)]
            chains[p] = (
                after
                if hop + 1 == dims
                else [
                    (nxt, mean, total)
                    for i, (slot, mean, total) in enumerate(after)
                    for nxt in next_slots(slot.coords, hop + 1, results[p, i][2], p, side)
                ]
            )
    for p in ids:
        _, values[p], weights[p] = chains[p][0]


@pytest.mark.parametrize("n,m", [(5, 2), (8, 2), (17, 4), (27, 3)])
def test_three_hops_give_the_exact_weighted_mean_too(n, m):
    """With d >= 3 a lone member's extra classes must travel on, or the groups of those
    classes in the later hops miss its slab (a relative error of order 1 on 5 peers)."""
    side, dims = grid_shape(n, m, dims=3)
    ids = [f"p{i}" for i in range(n)]
    for step in range(20):
        values = {p: torch.randn(16, dtype=torch.float64) for p in ids}
        weights = {p: float(i % 5 + 1) for i, p in enumerate(ids)}
        exact = sum(weights[p] * values[p] for p in ids) / sum(weights.values())
        _average_over_grid(ids, step, side, dims, m, values, weights)
        for p in ids:
            torch.testing.assert_close(values[p], exact)


@pytest.mark.parametrize("n,m", [(5, 2), (6, 2), (8, 2), (27, 3)])
def test_three_hops_of_uneven_groups_leave_every_peer_the_same_bits(n, m):
    """A group of a middle hop larger than the grid's side sends its mean on from several
    members, each with a share of its weight (½W·A + ½W·A), while another group of the next
    hop gets that mean from one member (W·A). Reducers merge rows equal bit for bit and sum
    weights correctly rounded, so both groups add the same terms, and a group that got only
    that mean holds it bit for bit, as a peer alone with it does: every peer ends with the
    same bits (before, an uneven swarm of 3 hops split its θ_g and re-synced each round)."""
    side, dims = grid_shape(n, m, dims=3)
    ids = [f"p{i}" for i in range(n)]
    shared = 0  # groups that got one mean from several members

    def mean_of(brought):
        nonlocal shared
        rows = [v for _, v in brought]
        shared += any(torch.equal(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :])
        return _reducers_mean(brought)

    for step in range(40):
        values = {p: dequantize(quantize(torch.randn(8192))) for p in ids}  # Δ as hop 0 sends it
        weights = {p: float(256 * (11 + 2 * i)) for i, p in enumerate(ids)}  # tokens
        exact = sum(weights[p] * values[p].double() for p in ids) / sum(weights.values())
        _average_over_grid(ids, step, side, dims, m, values, weights, mean_of=mean_of)
        reference = values[ids[0]]
        assert all(torch.equal(values[p], reference) for p in ids), f"step {step}: θ_g split"
        torch.testing.assert_close(reference.double(), exact, rtol=0.05, atol=0.02)  # int8 hops
    assert shared > 0  # the test did meet them


@pytest.mark.parametrize("n,m", [(9, 3), (12, 4), (6, 3), (16, 4), (5, 4), (4, 4), (30, 16), (24, 4), (32, 4)])
def test_uneven_hashed_cells_still_give_the_exact_weighted_mean_in_two_hops(n, m):
    """Hashed cells fill unevenly (1 to 5 peers), yet every peer ends with the exact token-
    weighted global mean: classes taken from ranks in agreed groups cover every group once."""
    side, dims = grid_shape(n, m)
    assert dims <= 2
    ids = [f"p{i}" for i in range(n)]
    uneven = 0
    for step in range(40):
        cells = Counter(coordinates(p, step, side, dims)[1:] for p in ids)
        uneven += len(set(cells.values())) > 1
        values = {p: torch.randn(16, dtype=torch.float64) for p in ids}
        weights = {p: float(i % 5 + 1) for i, p in enumerate(ids)}
        exact = sum(weights[p] * values[p] for p in ids) / sum(weights.values())
        _average_over_grid(ids, step, side, dims, m, values, weights)
        for p in ids:
            torch.testing.assert_close(values[p], exact)
    assert dims == 1 or uneven > 0  # the test did meet uneven cells


def test_classes_cover_every_class_once_per_group():
    for size in range(1, 9):
        for side in (2, 3, 4):
            cover = Counter()
            for rank in range(size):
                for cls, share in classes_of(rank, size, side):
                    cover[cls] += share
            assert dict(cover) == pytest.approx({c: 1.0 for c in range(side)})


def test_a_peer_missing_from_a_view_moves_only_its_own_cell():
    """Placement is a function of a peer's own id and the step: one view missing a peer
    expects the same cells as the full view for everyone else."""
    ids = [f"p{i}" for i in range(12)]
    full = cells(ids, 5, 4, 2)
    for missing in ids:
        skewed = cells([p for p in ids if p != missing], 5, 4, 2)
        own_cell = next(k for k, members in full.items() if missing in members)
        for key, members in full.items():
            assert skewed.get(key, set()) == members - {missing}, (missing, key)
            assert key == own_cell or missing not in members
    assert coordinates("p1", 3, 3, 2) != coordinates("p1", 4, 3, 2) or coordinates("p1", 5, 3, 2) != coordinates(
        "p1", 3, 3, 2
    )  # cells reshuffle with the step
    assert hop_key((1, 2), 0) == "2" and hop_key((1, 2), 1) == "1" and hop_key((5,), 0) == "all"


def test_a_later_hop_waits_its_window_and_the_deadline_of_the_all_reduce_before_it(dht):
    """A peer alone in its hop-0 cell registers for hop 1 at once, while the peers it waits
    for there may still be in their hop-0 all-reduce (of a large model: a minute). With only
    the matchmaking window, its group closed before they came, and they met without it: the
    mean was no longer the swarm's. A later hop's window now adds the all-reduce deadline."""
    from allreduce_harness import start_peers, stop_peers

    async def main():
        peers = await start_peers(2, run_id="later-hop-run")
        ids = [p.member.peer_id for p in peers]

        async def view():
            return {p: PeerRecord(peer_id=p, state="averaging", model_hash="m", outer_step=0) for p in ids}

        async def run(i: int, peer):
            averager = MoshpitAverager(
                AveragingConfig("later-hop-run", "m", 2, grid_dims=2, wire=WireFormat(Compression.INT8, 64)),
                peer.member.peer_id,
                view,
                Matchmaker(dht, "later-hop-run", peer.member, poll_interval=0.05),
                peer.registry,
                peer.channels,
                AdaptiveDeadlines(window_min=2.0, window_max=10.0, timeout_min=5.0, timeout_max=20.0),
            )

            async def no_state():
                raise AssertionError("no re-sync was asked for")

            return await averager.average(0, torch.full((1000,), float(i)), 1.0, False, no_state)

        try:
            results = await asyncio.gather(*(run(i, p) for i, p in enumerate(peers)))
        finally:
            await stop_peers(peers)
        for result in results:
            first, second = result.hops
            assert first.window_s <= 10.0 and second.window_s >= 10.0 + 5.0
            torch.testing.assert_close(result.mean, torch.full((1000,), 0.5), atol=0.05, rtol=0)

    asyncio.run(main())


def test_deadlines_follow_measurements_within_bounds():
    d = AdaptiveDeadlines(window_min=1.0, window_max=15.0, timeout_min=3.0, timeout_max=60.0)
    assert d.matchmaking_window == 15.0 and d.allreduce_timeout(10**6) == 60.0  # nothing measured yet
    d.observe_matchmaking(0.4, complete=True)
    d.observe_matchmaking(9.0, complete=False)  # closed by the window: says nothing about arrival times
    assert d.matchmaking_window == pytest.approx(3 * 0.4 + 0.5)
    d.observe_allreduce(10**8, 1.0, ok=True)  # 100 MB/s
    assert d.allreduce_timeout(10**6) == 3.0  # clamped to the lower bound
    assert d.allreduce_timeout(10**9) == pytest.approx(31.0)
    assert d.allreduce_timeout(10**11) == 60.0
    assert d.later_hop_window(10**9) == pytest.approx(15.0 + 31.0)  # its peers may still be in that all-reduce
    assert expected_payload_bytes(1000, 1, WireFormat(Compression.INT8, 256)) == 0
    # 500 values out and 500 in, then 500 results each way: as the measured rates count them
    assert expected_payload_bytes(1000, 2, WireFormat(Compression.FP32, 256)) == 8000
    # a sparse round moves about 0.03 bytes per value out and at most a union's worth back
    assert 0 < expected_payload_bytes(4096 * 100, 4, WireFormat(Compression.SPARSE, 4096, 64)) < 0.2 * 4096 * 100


def test_an_all_reduce_cut_at_its_deadline_makes_the_next_one_of_its_size_wait_longer():
    """Issue 60: learning only from all-reduces that finished, a deadline learned in a quiet hop 0
    cut every busier hop 1 of a 24-node swarm at the 3 s floor, round after round. A cut counts
    as the rate it fell short of: the next deadline of that size is 3x the cut one plus 1 s, up
    to the upper bound, and the history forgets it after `history` all-reduces."""
    d = AdaptiveDeadlines(window_min=1.0, window_max=15.0, timeout_min=3.0, timeout_max=60.0, history=4)
    d.observe_allreduce(10**8, 1.0, ok=True)  # a quiet hop: 100 MB/s
    assert d.allreduce_timeout(10**7) == 3.0  # the floor
    d.observe_cut(10**7, 3.0)  # a busy hop of 10 MB, cut at 3 s
    assert d.allreduce_timeout(10**7) == pytest.approx(10.0)
    d.observe_cut(10**7, 10.0)  # cut again
    assert d.allreduce_timeout(10**7) == pytest.approx(31.0)
    d.observe_cut(10**7, 31.0)
    assert d.allreduce_timeout(10**7) == 60.0  # never past the upper bound
    d.observe_cut(0, 3.0)  # nothing was expected of it: says nothing
    for _ in range(4):
        d.observe_allreduce(10**8, 1.0, ok=True)
    assert d.allreduce_timeout(10**7) == 3.0  # forgotten


def test_only_an_all_reduce_that_ran_to_its_deadline_short_of_a_part_or_sender_counts_as_cut():
    from dtnode.peers.allreduce_report import AllReduceReport, PartOutcome
    from dtnode.peers.group_reduce import _cut_at_deadline

    def report(seconds: float, *parts: PartOutcome) -> AllReduceReport:
        return AllReduceReport(list(parts), seconds=seconds)

    whole = [PartOutcome(p, f"r{p}", True, ["a", "b", "c"]) for p in range(3)]
    dropped = [PartOutcome(0, "r0", True, ["a", "b"]), *whole[1:]]
    failed = [PartOutcome(0, "r0", False, error="DEADLINE_EXCEEDED: no chunk"), *whole[1:]]
    assert not _cut_at_deadline(report(3.0, *whole), 3, 3.0)  # every part, every sender: slow, not cut
    assert _cut_at_deadline(report(2.9, *failed), 3, 3.0)  # a part lost at the deadline
    assert _cut_at_deadline(report(3.0, *dropped), 3, 3.0)  # a sender dropped at the deadline
    assert not _cut_at_deadline(report(0.4, *failed), 3, 3.0)  # a member found gone early: no rate in it
    assert not _cut_at_deadline(report(0.4, *dropped), 3, 3.0)


def test_a_later_hop_of_an_uneven_grid_gives_its_all_reduce_time_for_a_group_mate_covering_two_cells():
    from dtnode.peers.averager import hop_load

    assert hop_load(1, 0, 5, 2, 3) == 1  # hop 0: every peer stands in its own cell only
    assert hop_load(1, 1, 8, 2, 3) == 1  # a full 2x2x2 grid: nobody covers two cells
    assert hop_load(1, 2, 5, 2, 3) == 2  # 5 peers on 8 cells: a group-mate may carry two groups
    assert hop_load(3, 1, 5, 2, 3) == 3  # this node's own three slots
    assert hop_load(3, 1, 8, 2, 3) == 3


def test_a_group_deadline_allows_for_the_member_standing_in_the_most_groups():
    """A member alone in its hop-0 cell stands in every class of hop 1, 4 all-reduces at once on
    its link and cores: each of its groups' deadlines counts those 4 (its registration says so),
    whatever the other members run; a registration claims at most MAX_LOAD, and a swarm-key tag
    signs the load, so nobody in between raises it."""
    from dtnode.peers.auth import SwarmAuth
    from dtnode.peers.group_board import MAX_LOAD

    members = [replace(_member("a"), load=4), _member("b"), _member("c")]
    assert group_load(1, members) == 4
    assert group_load(2, members[1:]) == 2  # this node's own (`hop_load`) when nobody announced more
    with pytest.raises(ValidationError):
        Registration(grpc_addr="127.0.0.1:1", load=MAX_LOAD + 1)
    with pytest.raises(ValidationError):
        Registration(grpc_addr="127.0.0.1:1", load=0)
    alice, bob = SwarmAuth(b"k" * 32, "alice"), SwarmAuth(b"k" * 32, "bob")
    reg = Registration(grpc_addr="127.0.0.1:1", load=4)
    tag = alice.issue("register", reg.subject("key"))
    bob.verify("register", reg.subject("key"), tag, peer_id="alice", single_use=False, max_age=None)
    raised = reg.model_copy(update={"load": 16})
    with pytest.raises(AuthError):
        bob.verify("register", raised.subject("key"), tag, peer_id="alice", single_use=False, max_age=None)
    # a load of 1 signs as a registration did before the field existed
    assert Registration(grpc_addr="x").subject("key") == Registration(grpc_addr="x", load=1).subject("key")


def test_a_later_hop_waits_for_peers_still_in_the_two_all_reduces_a_group_mate_covered_the_hop_before():
    """Hop 2 of 5 peers on a 2x2x2 grid: a peer on its way may have covered two cells in hop 1,
    on a deadline for both; the window waits that long. Hop 1 follows hop 0, where nobody
    covers two cells, and a full grid has no such peer."""
    from dtnode.peers.averager import later_hop_window

    d = AdaptiveDeadlines(window_min=1.0, window_max=15.0, timeout_min=3.0, timeout_max=600.0)
    d.observe_allreduce(10**6, 1.0, ok=True)  # 1 MB/s
    numel, wire = 10**6, WireFormat(Compression.FP32, 256)
    one = expected_payload_bytes(numel, 4, wire, 1)  # a group of up to 2 x side members
    assert later_hop_window(d, numel, wire, 2, 5, 2, 3) == pytest.approx(15.0 + 3 * 2 * one / 10**6 + 1.0)
    assert later_hop_window(d, numel, wire, 2, 8, 2, 3) == pytest.approx(15.0 + 3 * one / 10**6 + 1.0)
    assert later_hop_window(d, numel, wire, 1, 5, 2, 3) == pytest.approx(15.0 + 3 * one / 10**6 + 1.0)


@pytest.fixture(scope="module")
def dht():
    node = ready_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


def _member(name: str) -> Member:
    return Member(name, f"127.0.0.1:{abs(hash(name)) % 50000 + 1000}")


def test_two_cells_form_their_own_groups(dht):
    async def main():
        makers = {p: Matchmaker(dht, "mm-cells", _member(p), poll_interval=0.05) for p in "abcd"}
        cell = {"a": "x", "b": "x", "c": "y", "d": "y"}
        expected = {"x": {"a", "b"}, "y": {"c", "d"}}
        share = {"a": 0.5, "b": 1.0, "c": 0.25, "d": 1.0}  # of their previous groups' means
        load = {"a": 1, "b": 4, "c": 2, "d": 1}  # the groups each stands in this hop

        async def form(p):
            async def want():
                return expected[cell[p]]

            return await makers[p].form_group(
                0, 1, want, window=10, target_size=4, cell=cell[p], share=share[p], load=load[p]
            )

        groups = await asyncio.gather(*(form(p) for p in "abcd"))
        for p, g in zip("abcd", groups):
            assert sorted(m.peer_id for m in g.members) == sorted(expected[cell[p]])
            assert g.complete and g.key.endswith(f".1.{cell[p]}")  # closed by its expectation, not the window
            assert {m.peer_id: m.share for m in g.members} == {q: share[q] for q in expected[cell[p]]}
            assert {m.peer_id: m.load for m in g.members} == {q: load[q] for q in expected[cell[p]]}
        # every member of a group allows for its most loaded member's all-reduces
        assert [group_load(1, g.members) for g in groups] == [4, 4, 2, 2]

    asyncio.run(main())


async def _register(maker: Matchmaker, key: str) -> None:
    """A registration written by hand, as a peer that then does something else would leave it."""
    reg = Registration(grpc_addr=maker.own.grpc_addr)
    await maker.dht.store(
        key, subkey=maker.own.peer_id, value=reg.model_dump(), expiration_time=get_dht_time() + 60, return_future=True
    )


def _ranked(run_id: str, names: str) -> list[str]:
    """`names` in the rank order of the key of round 0, hop 0 (leadership.rank): the first leads."""
    return by_rank(f"{run_id}.group.0.0.all", names)


def test_a_latecomer_finds_its_group_closed_and_does_not_wait_the_window(dht):
    async def main():
        makers = {p: Matchmaker(dht, "mm-late", _member(p), poll_interval=0.05) for p in "abc"}

        async def want():
            return {"a", "b", "c"}

        async def pair():
            async def two():
                return {"a", "b"}

            return await asyncio.gather(*(makers[p].form_group(0, 0, two, window=10, target_size=3) for p in "ab"))

        a, b = await pair()
        c = await makers["c"].form_group(0, 0, want, window=10, target_size=3)
        # a and b are taken (they confirmed their list): nobody is left to wait for, so c
        # closes whole, not by the window, whatever its rank
        assert [m.peer_id for m in c.members] == ["c"] and c.complete
        assert [m.peer_id for m in a.members] == [m.peer_id for m in b.members] == ["a", "b"]
        formed = await makers["a"].formed(makers["a"].group_key(0, 0))
        assert formed == {"a": ("a", "b"), "b": ("a", "b"), "c": ("c",)}

    asyncio.run(main())


def test_a_latecomer_to_a_grids_last_hop_finds_its_group_closed_and_calls_its_own_list_not_whole(dht):
    """In a grid's last hop two groups of one key end with two means (no next hop takes a share
    of each): a latecomer alone there holds a mean without the others' shares, and said `full`
    (32 nodes: a node late to hop 1 counted its round whole while its θ_g differed). It still
    does not wait the window for peers already taken."""

    async def main():
        makers = {p: Matchmaker(dht, "mm-late-last", _member(p), poll_interval=0.05) for p in "abc"}

        async def want():
            return {"a", "b", "c"}

        async def two():
            return {"a", "b"}

        await asyncio.gather(*(makers[p].form_group(0, 1, two, window=10, target_size=3, last_hop=True) for p in "ab"))
        started = time.monotonic()
        c = await makers["c"].form_group(0, 1, want, window=10, target_size=3, last_hop=True)
        assert [m.peer_id for m in c.members] == ["c"] and not c.complete
        assert time.monotonic() - started < 8.0  # not the 10 s window: nobody was left to come

    asyncio.run(main())


def test_a_benched_member_is_not_missed_and_in_a_grids_last_hop_only_after_a_second_strike(dht):
    """A benched member (absentees.py) let this node's groups down: it is neither waited for nor
    missed (a swarm that benched a hostile member counts its rounds without it whole:
    `test_hostile_swarm`). In the last hop of a grid of several hops, though, a member left out
    takes its share of the swarm's mean with it and parts θ_g anyway (32 nodes: an honest member
    taken for absent once split its last-hop group the next round), so there it is left out only
    once struck again after its first bench; a first strike is named like anyone."""

    async def main():
        async def want():
            return {"a", "b", "x"}

        # (round, the rounds x was struck in, last hop, benched there)
        for round_no, strikes, last_hop, benched in (
            (1, [0], False, True),
            (4, [0, 3], True, True),
            (1, [0], True, False),
        ):
            run_id = next(
                r
                for i in range(64)
                if by_rank(f"{(r := f'mm-benched-{round_no}-{last_hop}-{i}')}.group.{round_no}.1.all", "abx")[0] != "x"
            )  # x does not lead: where it is let in, the leader closes on it at once
            makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=0.3) for p in "abx"}
            for p in "ab":
                for struck in strikes:
                    makers[p].absentees.strike(struck, ["x"])
            await _register(makers["x"], makers["x"].group_key(round_no, 1))
            started = time.monotonic()
            groups = await asyncio.gather(
                *(makers[p].form_group(round_no, 1, want, window=30.0, target_size=3, last_hop=last_hop) for p in "ab")
            )
            named = ["a", "b"] if benched else ["a", "b", "x"]
            assert all([m.peer_id for m in g.members] == named for g in groups), (strikes, last_hop)
            assert all(g.complete and g.benched == (("x",) if benched else ()) for g in groups), (strikes, last_hop)
            assert time.monotonic() - started < 10.0  # benched or not, nobody waited the window

    asyncio.run(main())


def test_the_lowest_ranked_registrant_closes_and_everyone_agrees(dht):
    """Nobody says who came first: the registrant ranked lowest for the key (a hash of the key
    and its id) closes the group, and only its list is published."""

    async def main():
        makers = {p: Matchmaker(dht, "mm-rank", _member(p), poll_interval=0.05) for p in "abcd"}

        async def want():
            return set("abcd")

        groups = await asyncio.gather(*(makers[p].form_group(0, 0, want, window=10, target_size=4) for p in "abcd"))
        assert all([m.peer_id for m in g.members] == list("abcd") and g.complete for g in groups)
        closed = await makers["a"].board.member_lists(makers["a"].group_key(0, 0), "closed")
        assert set(closed) == {_ranked("mm-rank", "abcd")[0]}

    asyncio.run(main())


def test_a_leader_that_never_closes_holds_its_followers_only_until_their_own_deadline(dht):
    """Issue 56, finding 1: a registrant that led (it claimed to have registered first) and never
    closed held every follower until the close-by time it announced, an hour or years away. The
    leader is now the lowest-ranked registrant, and a follower gives up on it on its own clock:
    its window (or less, once everyone it expects has registered), the settle time and a grace.
    The others then meet without it, on one list."""

    async def main():
        async def want():
            return {"a", "b", "c"}

        for run_id, window in (("mm-silent", 0.5), ("mm-silent-long", 30.0)):
            leader, *followers = _ranked(run_id, "abc")
            makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=0.3) for p in "abc"}
            await _register(makers[leader], makers[leader].group_key(0, 0))  # and never closes
            started = time.monotonic()
            groups = await asyncio.gather(
                *(makers[p].form_group(0, 0, want, window=window, target_size=3) for p in followers)
            )
            took = time.monotonic() - started
            assert all([m.peer_id for m in g.members] == sorted(followers) and not g.complete for g in groups)
            # its window (or less: everyone expected registered at once), settle, grace, and polls of slack
            assert took < min(window, 0.5) + 0.3 + 2.0 + 3.0, (window, took)

    asyncio.run(main())


def test_a_leader_passed_over_once_is_benched_and_not_waited_for_in_the_next_rounds(dht):
    """Issue 56 (the silent leader's cost): a registrant that leads and never closes cost its
    followers a settle time and a grace in every round it ranked first. Passed over once, it is
    benched (peers/absentees.py): the next round its followers neither wait for it nor name it,
    close at once and count their group whole; past the bench, it is waited for again."""

    async def main():
        async def want():
            return {"a", "b", "c"}

        # a run whose silent registrant ranks first in rounds 0 and 1 (rank changes with the key)
        run_id = next(
            f"mm-benched-{i}"
            for i in range(1000)
            if all(by_rank(f"mm-benched-{i}.group.{r}.0.all", "abc")[0] == "a" for r in (0, 1))
        )
        makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=0.3) for p in "abc"}
        for round_no in (0, 1):
            await _register(makers["a"], makers["a"].group_key(round_no, 0))  # and never closes
            started = time.monotonic()
            groups = await asyncio.gather(
                *(makers[p].form_group(round_no, 0, want, window=30.0, target_size=3) for p in "bc")
            )
            took = time.monotonic() - started
            assert all([m.peer_id for m in g.members] == ["b", "c"] for g in groups), round_no
            if round_no == 0:  # waited for it: settle and a grace, and the group is not whole
                assert not any(g.complete for g in groups) and took > 0.3 + 0.5, took
            else:  # benched: not waited for, not missed, and said so (`/status` hops' `benched`)
                assert all(g.complete and g.benched == ("a",) for g in groups)
                assert took < 0.3 + 0.5, took
        assert all(makers[p].absentees.strikes("a") == 1 for p in "bc")
        assert not any("a" in makers[p].absentees.benched(1 + BENCH_ROUNDS + 1) for p in "bc")

    asyncio.run(main())


def test_members_that_benched_the_leader_hold_the_list_that_led_past_it_for_those_that_did_not(dht):
    """A bench is one node's view (peers/absentees.py). A member that benched the registrant
    ranked first led past it at once and took its own list for its group (and so did a follower
    that benched it too), while a member that did not bench it waited for it as its leader and
    took the list it closed a moment later: two groups of one key, neither whole, and θ_g split
    (24 nodes, `drills.sh uneven`). The list that led past a benched leader is now held, by its
    publisher until its members confirm it, by a member that benched it too while another
    declines it; meanwhile the list the benched leader closed is the group: one group."""

    async def main(run_id: str, names: str, benching: int):
        slow, *others = _ranked(run_id, names)
        makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=0.3) for p in names}
        for p in others[:benching]:  # the jumper (ranked next) and maybe a follower: it let their group down
            makers[p].absentees.strike(0, [slow])

        async def form(p):
            async def want():  # the slow leader waits its whole window for a peer that never comes
                return set(names) | ({"z"} if p == slow else set())

            window = 0.8 if p == slow else 10.0
            return await makers[p].form_group(0, 0, want, window, target_size=len(names))

        groups = await asyncio.gather(*(form(p) for p in names))
        assert [[m.peer_id for m in g.members] for g in groups] == [sorted(names)] * len(names), benching
        assert set(await makers[slow].formed(makers[slow].group_key(0, 0))) == set(names)

    asyncio.run(main("mm-jumped", "abc", benching=1))
    asyncio.run(main("mm-jumped-2", "abcd", benching=2))
    # a pair: the member that benched the leader led past it alone, averaged alone, and the leader,
    # whose list named it, struck it for its absence (CI: two honest peers of a 3-peer swarm then
    # benched each other in turn, to the end of the run, and ended it with two θ_g). Its lone
    # list is held too: the leader's list, closed a moment later, is the group
    asyncio.run(main("mm-jumped-pair", "ab", benching=1))


async def _wait_for_list(maker: Matchmaker, key: str, publisher: str, timeout: float = 20.0) -> None:
    """Until `publisher`'s closed list under `key` can be read."""
    deadline = time.monotonic() + timeout
    while publisher not in await maker.board.member_lists(key, "closed"):
        assert time.monotonic() < deadline, f"no list from {publisher}"
        await asyncio.sleep(0.05)


def test_a_follower_that_led_alone_past_its_leader_takes_that_leaders_list_published_while_it_settles(dht):
    """Issue 60, 32 nodes on 2 cores: a follower of a hop-0 cell passed over its first leader (it
    never closed) and then the next one, whose list was on its way, and averaged alone; that
    leader's list, out a moment later, named it. The leader averaged alone too but stood in its
    rank's classes of hop 1 only, while the follower stood in all of them, and the round ended on
    two θ_g. A follower that led alone past a leader now settles as a group of two does: the
    leader's list, read then, is its group, and the strike for that leader is taken back."""

    async def main():
        run_id = "mm-late-list"
        silent, leader, follower = _ranked(run_id, "xlf")
        makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=2.0) for p in "xlf"}
        key = makers[follower].group_key(0, 0)
        await _register(makers[silent], key)  # it never closes
        await _register(makers[leader], key)  # it closes once the follower has given up on it

        async def want():
            return {silent, leader, follower}

        async def leader_late():
            await _wait_for_list(makers[leader], key, follower)  # the follower led alone
            await makers[leader].board.publish(key, "closed", (leader, follower))

        group, _ = await asyncio.gather(
            makers[follower].form_group(0, 0, want, window=0.5, target_size=3), leader_late()
        )
        assert {m.peer_id for m in group.members} == {leader, follower} and not group.complete
        assert set((await makers[follower].formed(key))[follower]) == {leader, follower}
        assert makers[follower].absentees.benched(1) == {silent}  # the leader that came is not benched

    asyncio.run(main())


def test_a_leader_whose_follower_went_on_alone_goes_on_alone_too(dht):
    """The other side of the test above: the follower's list of one and its `formed` record are
    final, and a leader that reads them goes on alone as well, so that both stand in every class
    of the next hop. A leader that reads them before it closes does not name the follower; one
    that reads them while settling its list takes it back."""

    async def main(run_id: str, before_close: bool):
        silent, leader, follower = _ranked(run_id, "xlf")
        makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=1.5) for p in "xlf"}
        key = makers[leader].group_key(0, 0)
        await _register(makers[silent], key)  # it never closes
        await _register(makers[follower], key)

        async def want():
            return {silent, leader, follower}

        async def follower_alone():
            if not before_close:
                await _wait_for_list(makers[follower], key, leader)
            await makers[follower].board.publish(key, "closed", (follower,))
            await makers[follower].board.publish(key, "formed", (follower,))

        if before_close:
            await follower_alone()
        group, _ = await asyncio.gather(
            makers[leader].form_group(0, 0, want, window=0.5, target_size=3),
            follower_alone() if not before_close else asyncio.sleep(0),
        )
        assert [m.peer_id for m in group.members] == [leader] and not group.complete, run_id
        assert (await makers[leader].formed(key))[leader] == (leader,)
        closed = await makers[leader].board.member_lists(key, "closed")
        assert set(closed[leader].members) == ({leader} if before_close else {leader, follower})

    asyncio.run(main("mm-alone-before", before_close=True))
    asyncio.run(main("mm-alone-settling", before_close=False))


def test_a_registrant_refused_for_a_weight_of_0_is_not_waited_for_to_the_windows_end(dht):
    """Issue 56 (the zero-weight attacker's cost): a member whose own registration is refused
    (here a weight of 0) came, and will be in no group of ours; its group-mates expected it, and
    waited their whole window for it every round. They now close as soon as the others are in,
    and their group counts as whole (no re-sync follows it), whatever the refused one's rank."""

    async def main():
        async def want():
            return {"a", "b", "c"}

        makers = {p: Matchmaker(dht, "mm-refused", _member(p), poll_interval=0.05, settle_s=0.3) for p in "abc"}
        for refused in "abc":
            key = makers[refused].group_key(refused_round := "abc".index(refused), 0)
            value = Registration(grpc_addr=makers[refused].own.grpc_addr).model_dump() | {"weight": 0.0}
            await dht.store(key, subkey=refused, value=value, expiration_time=get_dht_time() + 60, return_future=True)
            others = [p for p in "abc" if p != refused]
            started = time.monotonic()
            groups = await asyncio.gather(
                *(makers[p].form_group(refused_round, 0, want, window=30.0, target_size=3) for p in others)
            )
            took = time.monotonic() - started
            assert all([m.peer_id for m in g.members] == others and g.complete for g in groups), refused
            assert took < 10.0, (refused, took)  # not the 30 s window

    asyncio.run(main())


def test_a_formed_group_counts_the_members_that_announced_another_theta(dht):
    """What bounds a re-sync's pull on this node (`DriftBound.shared`): the other members whose
    announced θ_g hash is not its own, or is unknown (a node that does not know its own hash
    counts everyone)."""

    async def main():
        makers = {p: Matchmaker(dht, "mm-theta", _member(p), poll_interval=0.05) for p in "abcd"}
        thetas = {"a": "h1", "b": "h1", "c": "h2", "d": ""}

        async def want():
            return set("abcd")

        groups = await asyncio.gather(
            *(makers[p].form_group(0, 0, want, window=10, target_size=4, theta=thetas[p]) for p in "abcd")
        )
        assert [g.theta_apart for g in groups] == [2, 2, 3, 3]

    asyncio.run(main())


def test_a_list_that_jumps_ahead_of_its_leader_takes_nobody_and_a_made_up_id_isolates_nobody(dht, monkeypatch):
    """Issue 56, finding 1: a list backdated to time 0 always won, so a member could pair itself
    with any victim, and a list naming a made-up id sent every member it named to average alone.
    Lists now count only as their publisher's own group (it ranks lowest among them), a list
    that a pending leader ranked ahead of it holds is in force only once its members confirm it,
    and an id nobody registered is left out of a list. Here the peer ranked second publishes
    {itself, a victim, a made-up id} before anyone else closed: the leader still groups everyone.

    The victim declines the jumped list (it waits for the leader), so the leader does not hold
    its own list for confirmations that will not come: its hold used to cost every round the
    hostile bench's `hostile-pair` attacker sat in a settle time and HOLD_S. With a hold longer
    than everyone's window and grace, the group forms only if the decline ends it."""
    monkeypatch.setattr(matchmaking, "HOLD_S", 60.0)

    async def main():
        run_id = "mm-jumper"
        leader, jumper, *rest = _ranked(run_id, "abcd")
        makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=0.3) for p in "abcd"}
        key = makers[jumper].group_key(0, 0)
        victim = rest[0]
        for p in (jumper, victim):
            await _register(makers[p], key)
        await makers[jumper].board.publish(key, "closed", (jumper, victim, "ghost"), complete=True)

        async def want():
            return {leader, *rest}

        groups = await asyncio.gather(
            *(makers[p].form_group(0, 0, want, window=4, target_size=4) for p in (leader, *rest))
        )
        for group in groups:
            assert {m.peer_id for m in group.members} == {"a", "b", "c", "d"}  # the jumper too, by the leader's list
            assert group.complete  # nobody was passed over: the leader closed long before its 60 s hold
        declined = await makers[leader].board.declined(key)
        assert declined[victim] == {jumper}  # the victim said it would not take the jumper's list

    asyncio.run(main())


def test_a_list_on_hold_is_confirmable_until_most_of_its_members_decline_it():
    """`leadership.confirmable`: a list on hold is worth a leader's hold while most of the members
    it names besides its publisher formed with it or have not declined it."""
    from dtnode.peers.leadership import confirmable

    assert confirmable("p", ("p", "v"), {}, {})
    assert not confirmable("p", ("p", "v"), {}, {"v": {"p"}})
    assert confirmable("p", ("p", "v"), {"v": ("p", "v")}, {"v": {"p"}})  # declined, then took it
    assert not confirmable("p", ("p",), {}, {})  # nobody else to confirm it
    assert confirmable("p", ("p", "u", "v", "w"), {}, {"v": {"p"}})  # 2 of 3 may still confirm
    assert not confirmable("p", ("p", "u", "v", "w"), {}, {"v": {"p"}, "w": {"p", "q"}})
    assert confirmable("p", ("p", "v"), {}, {"v": {"q"}})  # another list declined


def test_a_made_up_id_in_the_leaders_list_is_left_out_and_the_others_still_meet(dht):
    """A leader's list naming an id nobody registered: its members wait a poll or so for that
    registration (a read may have missed it), then meet without it at their own deadline."""

    async def main():
        run_id = "mm-ghost"
        leader, *followers = _ranked(run_id, "abc")
        makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=0.3) for p in "abc"}
        key = makers[leader].group_key(0, 0)
        await _register(makers[leader], key)
        await makers[leader].board.publish(key, "closed", (leader, *followers, "zz-ghost"), complete=True)

        async def want():
            return {"a", "b", "c"}

        groups = await asyncio.gather(*(makers[p].form_group(0, 0, want, window=1, target_size=3) for p in followers))
        assert all(sorted(m.peer_id for m in g.members) == ["a", "b", "c"] for g in groups)

    asyncio.run(main())


def test_a_leader_whose_poll_outlasts_its_window_closes_by_its_deadline_with_whom_it_read(dht):
    """On a loaded host one poll of the DHT takes seconds. A leader that looked at its
    deadline only between polls closed seconds late; its followers, who wait a short grace
    past their own deadline, had closed without it, and the group split in two (the 9-node
    grid test on a 2-core host). A leader's poll is now cut half that grace past its deadline,
    and it closes with the registrants it had read; its later windows hold two of its slowest
    recent polls, so that it reads who came before it must close."""

    async def main():
        run_id = "mm-slow-leader"
        leader, follower_id = _ranked(run_id, "ab")
        makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=0.3) for p in "ab"}
        slow_from = time.monotonic() + 2.0  # by then both registered and the leader read the other

        async def leader_wants():
            if time.monotonic() > slow_from:
                await asyncio.sleep(30)  # a poll of a starved DHT
            return {"a", "b", "ghost"}  # a peer that never comes: the window closes the group

        async def follower_wants():
            return {"a", "b", "ghost"}

        started = time.monotonic()
        a, b = await asyncio.gather(
            makers[leader].form_group(0, 0, leader_wants, window=4, target_size=3),
            makers[follower_id].form_group(0, 0, follower_wants, window=4, target_size=3),
        )
        assert [m.peer_id for m in a.members] == [m.peer_id for m in b.members] == ["a", "b"]
        assert not a.complete and time.monotonic() - started < 15

        # and its next windows hold two such polls: the leader reads who came before it closes
        async def alone():
            return {leader}

        started = time.monotonic()
        await makers[leader].form_group(1, 0, alone, window=0.5, target_size=3)
        assert max(makers[leader]._poll_seconds) > 2.0

    asyncio.run(main())


def test_a_member_that_stops_seeing_its_leader_after_reading_its_list_still_joins_the_group(dht):
    """A read of a loaded swarm can miss records an earlier read saw: a lookup answered by a
    node that lacks them, or a membership record lapsing for a moment. A follower that read
    its leader's list, then re-read while settling and no longer saw the leader, averaged
    alone, while the leader and the others counted on its part (the 9-node grid test on a
    2-core host: a part "kept its own values", and θ_g split). What one read of a hop found
    now stays for that hop."""

    async def main():
        run_id = "mm-forgetful"
        leader, quick, forgetful = _ranked(run_id, "abc")
        makers = {
            p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=1.5 if p == forgetful else 0.2)
            for p in "abc"
        }
        everyone = {"a", "b", "c"}
        leader_done = asyncio.Event()

        async def wants():
            return everyone

        async def forgetful_admits():  # once the leader is done, this view of the swarm loses it
            return everyone - {leader} if leader_done.is_set() else everyone

        async def lead():
            group = await makers[leader].form_group(0, 0, wants, window=5, target_size=3)
            leader_done.set()
            return group

        async def follow(p, admitted=None):
            return await makers[p].form_group(0, 0, wants, window=5, target_size=3, admitted=admitted)

        a, b, c = await asyncio.gather(lead(), follow(quick), follow(forgetful, forgetful_admits))
        # the forgetful one read the leader's list within a poll and then settled 1.5 s, past its return
        assert leader_done.is_set()
        assert [m.peer_id for m in c.members] == [m.peer_id for m in a.members] == ["a", "b", "c"]
        assert [m.peer_id for m in b.members] == ["a", "b", "c"]

    asyncio.run(main())


def test_a_later_hop_waits_for_exactly_the_peers_whose_path_leads_there(dht):
    """M=2, d=3, 16 peers, hop 0 and hop 1 formed for real through the DHT. Every slot of hops 1
    and 2 must wait for exactly the peers whose groups send them there, worked out here from the
    grid rules: not for a member of a feeder group that goes on elsewhere (an extra class, or a
    first class leading to another slab), not for a peer that stopped, not for one that hop 0
    left out; but for one still forming hop 0 (late) and for one between hop 1 and hop 2 whose
    path so far leads here (in transit)."""

    async def main():
        run_id, side, dims = "mm-trace", 2, 3
        peers = [f"peer{i:02d}" for i in range(16)]
        coords = {p: coordinates(p, 0, side, dims, run_id) for p in peers}
        by_cell = cells(peers, 0, side, dims, run_id)
        left_out = next(p for p in peers if len(by_cell[hop_key(coords[p], 0)]) >= 2)
        late = next(p for p in peers if p != left_out and len(by_cell[hop_key(coords[p], 0)] - {left_out}) >= 2)
        rest = [p for p in peers if p not in (left_out, late)]
        in_transit, stopped = rest[0], rest[1]
        makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=0.2) for p in peers}

        async def form(hop: int, slots: dict[str, list[Slot]]) -> dict[tuple[str, str], list[str]]:
            """Every listed peer joins its slots' groups at once, as `average` does."""
            at: dict[str, set[str]] = {}
            for p, own in slots.items():
                for slot in own:
                    at.setdefault(slot.key, set()).add(p)

            async def join(p: str, key: str) -> tuple[tuple[str, str], list[str]]:
                async def want():
                    return at[key]

                group = await makers[p].form_group(0, hop, want, window=10, target_size=1 << 16, cell=f"d{dims}.{key}")
                return (p, key), [m.peer_id for m in group.members]

            return dict(await asyncio.gather(*(join(p, s.key) for p, own in slots.items() for s in own)))

        hop0 = {p: [first_slot(coords[p])] for p in rest}
        groups0 = await form(0, hop0)
        # late registers after its cell closed without it: it will form alone and go on
        await _register(makers[late], makers[late].group_key(0, 0, f"d{dims}.{hop_key(coords[late], 0)}"))
        hop1 = {p: next_slots(coords[p], 1, groups0[p, hop0[p][0].key], p, side) for p in rest}
        groups1 = await form(1, {p: s for p, s in hop1.items() if p != in_transit})
        hop2 = {
            p: [s for slot in hop1[p] for s in next_slots(slot.coords, 2, groups1[p, slot.key], p, side)]
            for p in rest
            if p != in_transit
        }

        async def view():
            return {
                p: PeerRecord(peer_id=p, state="stopped" if p == stopped else "averaging", model_hash="m")
                for p in peers
            }

        def keys(slots: list[Slot]) -> set[str]:
            return {s.key for s in slots}

        for hop, slots_by_peer in ((1, hop1), (2, hop2)):
            for owner, slots in slots_by_peer.items():
                slot = slots[0]
                truth = {p for p, own in slots_by_peer.items() if slot.key in keys(own)} | {late, owner}
                if hop == 2 and slot.coords[0] in {s.coords[0] for s in hop1[in_transit]}:
                    truth.add(in_transit)
                if hop == 1 and coords[late][2] != slot.coords[2]:
                    truth.discard(late)
                expectations = GroupExpectations(
                    run_id, "m", side, owner, view, makers[owner], AdaptiveDeadlines(1.0, 10.0, 1.0, 10.0)
                )
                wanted = await expectations.on_the_way(0, hop, dims, side, slot, {})
                assert wanted == truth - ({stopped} - {owner}), (hop, owner, slot)

    asyncio.run(main())


def test_a_peer_whose_record_says_it_trains_but_that_never_registers_costs_its_cell_one_window(dht):
    """Issue 56 (the shadowing member's cost): a peer whose own view of the DHT is broken waits
    for peers it cannot see while its record says it trains round 0; its cell waited out the
    whole window for it, round after round. Now a peer expected in the last round that never
    registered under its key, not even late, is not waited for in the next (the group closes
    whole as soon as the others are in); one that registered late, only slow, is waited for."""

    async def main():
        run_id, window = "mm-no-show", 3.0
        makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=0.2) for p in "ab"}
        slot = first_slot((0,))
        cells = {slot.key: {"a", "b", "ghost"}}

        at = [0]  # the round every record says it is in
        ghost_first = [-1]  # the ghost's `first_round`

        async def view():
            return {
                p: PeerRecord(
                    peer_id=p,
                    state="training",
                    model_hash="m",
                    outer_step=at[0],
                    first_round=ghost_first[0] if p == "ghost" else -1,
                )
                for p in ("a", "b", "ghost")
            }

        expect = {
            p: GroupExpectations(run_id, "m", 4, p, view, makers[p], AdaptiveDeadlines(1.0, 10.0, 1.0, 10.0))
            for p in "ab"
        }

        async def hop0(round_no: int) -> tuple[float, list]:
            at[0] = round_no
            started = time.monotonic()
            groups = await asyncio.gather(
                *(expect[p].form(round_no, 0, 1, 4, slot, cells, window, resync=False) for p in "ab")
            )
            return time.monotonic() - started, groups

        took, groups = await hop0(0)  # expected, never came: the window
        assert took >= window and all([m.peer_id for m in g.members] == ["a", "b"] and not g.complete for g in groups)
        took, groups = await hop0(1)  # not waited for: closed whole at once
        assert took < window and all([m.peer_id for m in g.members] == ["a", "b"] and g.complete for g in groups)
        assert await expect["a"].no_shows(1) == {"ghost"}
        ghost = Matchmaker(dht, run_id, _member("ghost"), poll_interval=0.05)
        await _register(ghost, ghost.group_key(1, 0, f"d1.{slot.key}"))  # it came after all, late: only slow
        took, groups = await hop0(2)
        assert await expect["a"].no_shows(2) == frozenset()
        assert took >= window and all(not g.complete for g in groups)
        # it missed round 2 too: a no-show for round 3, unless it restarted (or downloaded) since,
        # its record's first round past the one it missed: a new start, waited for again
        ghost_first[0] = 2
        assert await expect["b"].no_shows(3) == {"ghost"}
        ghost_first[0] = 3
        assert await expect["a"].no_shows(3) == frozenset()
        # and a peer whose first round is a later one (an --overlap joiner entering the next
        # round while this one is averaged) is not of this round's population: nobody waits for it
        assert await expect["a"].population(2) == {"a", "b"}
        assert await expect["a"].population(3) == {"a", "b", "ghost"}

    asyncio.run(main())


def test_a_node_counting_another_population_takes_the_grid_its_peers_records_say():
    """Issue 60: on a loaded 24-node swarm views counted 9 to 24 peers, and 9 nodes ran 2 hops
    while 15 ran 3 (their keys never meet; parts failed). A node takes the hops most of its
    round's peers published, its own record left out; a minority publishing another grid does not
    move it."""

    async def main():
        peers = [f"p{i:02d}" for i in range(24)]
        published = {p: 2 for p in peers[:14]} | {p: 7 for p in peers[14:20]} | {"p00": 3}  # p00 is this node

        async def view():
            return {
                p: PeerRecord(peer_id=p, state="training", model_hash="m", outer_step=5, grid_dims=published.get(p, 0))
                for p in peers
            }

        expect = GroupExpectations("grid-run", "m", 4, "p00", view, None, AdaptiveDeadlines(1.0, 10.0, 1.0, 10.0))
        population = await expect.population(5)
        assert await expect.grid_dims(population) == 2
        for counted in (9, 17, 24):  # whatever this node's view counts
            assert await expect.grid_dims(set(peers[:counted])) == 2
        published.update(dict.fromkeys(peers[1:14], 3))  # the swarm moved on: most say 3, which fits 24
        assert await expect.grid_dims(population) == 3
        assert await expect.grid_dims(set(peers[:4])) == 1  # four fit one group, whatever anyone says

    asyncio.run(main())


def _int8_averager(dht, run_id: str, peer, view) -> MoshpitAverager:
    """An averager of a harness peer (`allreduce_harness.start_peers`): int8, groups of up to 4."""
    return MoshpitAverager(
        AveragingConfig(run_id, "m", 4, wire=WireFormat(Compression.INT8, 64), chunk_elements=1024),
        peer.member.peer_id,
        view,
        Matchmaker(dht, run_id, peer.member, poll_interval=0.05),
        peer.registry,
        peer.channels,
        AdaptiveDeadlines(2.0, 10.0, 5.0, 20.0),
    )


def test_a_later_hop_still_waits_for_and_admits_a_peer_of_the_round_whose_record_lapsed(dht, monkeypatch):
    """On a loaded host a peer busy in an all-reduce beats late, or a DHT read misses its beat,
    and its record drops out of the others' views for a few seconds (in a 6-peer swarm of
    `small` on 2 cores one node saw 4 of its 5 peers go at once mid-round). Its class-mates of a
    later hop then stopped waiting for it and formed without it, and θ_g split. A peer seen in
    the round's population is now traced for LAPSE_GRACE_S after its record went, and let in;
    one whose record says it stopped is not, nor one gone for longer than that."""
    import dtnode.peers.expectations as expectations_module

    async def main():
        run_id, me, lapsed, stopped = "lapse-run", "peer-a", "peer-b", "peer-c"
        records = {
            p: PeerRecord(peer_id=p, state="averaging", model_hash="m", outer_step=3) for p in (me, lapsed, stopped)
        }
        view_now = dict(records)

        async def view():
            return view_now

        expectations = GroupExpectations(
            run_id,
            "m",
            2,
            me,
            view,
            Matchmaker(dht, run_id, _member(me), poll_interval=0.05),
            AdaptiveDeadlines(1.0, 10.0, 1.0, 10.0),
        )
        slot = Slot("0", 1.0, True, (0, 0))
        assert await expectations.population(3) == {me, lapsed, stopped}  # the round starts with all three
        assert await expectations.on_the_way(3, 1, 2, 2, slot, {}) == {me, lapsed, stopped}  # none formed hop 0 yet
        view_now.pop(lapsed)  # its record lapsed
        view_now[stopped] = records[stopped].model_copy(update={"state": "stopped"})
        assert await expectations.on_the_way(3, 1, 2, 2, slot, {}) == {me, lapsed}
        assert lapsed in await expectations.admissible() and stopped not in await expectations.admissible()
        monkeypatch.setattr(expectations_module, "LAPSE_GRACE_S", -1.0)  # gone for longer than the grace
        assert await expectations.on_the_way(3, 1, 2, 2, slot, {}) == {me}
        assert lapsed not in await expectations.admissible()
        assert await expectations.population(4) == {me}  # a new round starts from its own population

    asyncio.run(main())


def test_a_later_hop_traces_and_admits_a_peer_its_view_lacks_once_that_peer_formed_hop_0(dht):
    """Views lag: a node whose view lacks a peer (a 16-node swarm's first seconds) neither
    waited for that peer in its hop-1 group nor let it in, and the group closed `full` without
    the share the peer carried (a possible cause of a CI run's round-0 split of θ_g in four).
    A peer's own `formed` record of hop 0, under its own cell's
    key, now puts it on the paths a later hop traces and among those it admits, for this round
    only. A record under another cell's key vouches for nobody."""

    async def main():
        run_id, side, dims, round_no, me = "vouch-run", 2, 2, 3, "peer-me"
        names = [f"peer{i:02d}" for i in range(40)]
        coords = {p: coordinates(p, round_no, side, dims, run_id) for p in names}
        unseen = names[0]
        mate = next(p for p in names[1:] if coords[p][1] == coords[unseen][1])
        forger = next(p for p in names[1:] if coords[p][1] != coords[unseen][1])
        makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05) for p in (me, unseen, mate, forger)}
        cell = f"d{dims}.{hop_key(coords[unseen], 0)}"

        async def pair(p: str) -> list[str]:
            async def want():
                return {unseen, mate}

            group = await makers[p].form_group(round_no, 0, want, window=10, target_size=2, cell=cell)
            return [m.peer_id for m in group.members]

        assert await asyncio.gather(pair(unseen), pair(mate)) == [sorted([unseen, mate])] * 2
        # the forger's record names the unseen peer too, under a cell that is not the forger's own
        await makers[forger].board.publish(makers[forger].group_key(round_no, 0, cell), "formed", (forger, unseen))
        view_now = {
            p: PeerRecord(peer_id=p, state="averaging", model_hash="m", outer_step=round_no) for p in (me, mate)
        }

        async def view():
            return view_now

        expectations = GroupExpectations(
            run_id, "m", side, me, view, makers[me], AdaptiveDeadlines(1.0, 10.0, 1.0, 10.0)
        )
        landing = (sorted([unseen, mate]).index(unseen), coords[unseen][1])  # the unseen peer's class in hop 1
        slot = Slot(hop_key(landing, 1), 1.0, True, landing)
        assert unseen not in await expectations.admissible()
        assert await expectations.population(round_no) == {me, mate}
        assert await expectations.on_the_way(round_no, 1, dims, side, slot, {}) == {me, unseen}
        admitted = await expectations.admissible()
        assert unseen in admitted and forger not in admitted
        assert await expectations.population(round_no + 1) == {me, mate}  # the next round vouches anew
        assert unseen not in await expectations.admissible()

    asyncio.run(main())


def test_two_groups_re_syncing_one_theta_brought_by_different_numbers_of_members_agree():
    """Moshpit's later hops: a group of 3 hands class 0 to two members (½ of its mean each) and
    class 1 to one (all of it), so one group of the next hop gets θ_1 from two members and
    another from one, beside the same θ_b. At weight 1 per member their re-syncs gave
    (2θ_1 + θ_b)/3 and (θ_1 + θ_b)/2: θ_g split again in the round that re-synced it (a 6-peer
    swarm in pairs). Weighted by the shares they bring, both give the same bits."""
    from allreduce_harness import allreduce, start_peers, stop_peers

    from dtnode.peers.plan import FP32

    async def main():
        peers = await start_peers(5)
        gen = torch.Generator().manual_seed(4)
        theta_1, theta_b = torch.randn(3000, generator=gen), torch.randn(3000, generator=gen)
        two = [replace(p.member, share=s) for p, s in zip(peers[:3], (0.5, 0.5, 1.0))]
        one = [replace(p.member, share=1.0) for p in peers[3:]]
        try:
            results = {}
            for rule, weight_of in (("share", lambda m: m.share), ("one", lambda m: 1.0)):
                outs_two, _ = await allreduce(
                    peers[:3],
                    [theta_1.clone(), theta_1.clone(), theta_b.clone()],
                    [weight_of(m) for m in two],
                    members=[replace(m, weight=weight_of(m)) for m in two],
                    codec=FP32,
                    round=len(results),
                )
                outs_one, _ = await allreduce(
                    peers[3:],
                    [theta_1.clone(), theta_b.clone()],
                    [weight_of(m) for m in one],
                    members=[replace(m, weight=weight_of(m)) for m in one],
                    codec=FP32,
                    round=len(results),
                )
                results[rule] = (outs_two[0], outs_one[0])
        finally:
            await stop_peers(peers)
        assert torch.equal(*results["share"])  # bit for bit
        torch.testing.assert_close(results["share"][0], (theta_1 + theta_b) / 2)
        assert not torch.equal(*results["one"])  # the rule it replaces

    asyncio.run(main())


def test_the_average_reads_delta_only_once_its_copy_from_the_device_is_in(dht):
    """A node hands the averager Δ while its copy from the GPU may still be under way
    (daemon/training/outer_replica.py): the averager must wait for `delta_ready` before any read. Here the
    buffers hold NaN until it is awaited, so one early read fails the round (int8 refuses
    non-finite values) and the mean comes out wrong."""
    from allreduce_harness import start_peers, stop_peers

    async def main():
        peers = await start_peers(2, run_id="ready-run")
        ids = [p.member.peer_id for p in peers]
        numel = 3000
        truth = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        deltas = [torch.full((numel,), float("nan")) for _ in ids]
        awaited = []

        async def view():
            return {p: PeerRecord(peer_id=p, state="averaging", model_hash="m", outer_step=0) for p in ids}

        def ready_for(i: int):
            async def ready() -> None:
                await asyncio.sleep(0.2)  # the copy engine, still at work
                deltas[i].copy_(truth[i])
                awaited.append(ids[i])

            return ready

        async def run(i: int, peer):
            averager = _int8_averager(dht, "ready-run", peer, view)

            async def no_state():
                raise AssertionError("no re-sync was asked for")

            return await averager.average(0, deltas[i], 1.0, False, no_state, delta_ready=ready_for(i))

        try:
            results = await asyncio.gather(*(run(i, p) for i, p in enumerate(peers)))
        finally:
            await stop_peers(peers)
        assert sorted(awaited) == sorted(ids)
        mean = (truth[0] + truth[1]) / 2
        for result in results:
            assert result.clean and result.hops[0].group_size == 2
            torch.testing.assert_close(result.mean, mean, atol=0.05, rtol=0)
        assert torch.equal(results[0].mean, results[1].mean)

    asyncio.run(main())


def test_nobody_writes_another_peers_registration_or_member_list(tmp_path):
    """Issue 31, finding 3: registrations and member lists lived under plain subkeys, so anyone
    could publish `{members: [victim], at: 0}` as the victim's closed list and make it average
    alone. A node's entries now sit under subkeys only its identity key can sign, and readers
    count an entry only under its own peer's key: the attacker's entries, under the victim's
    name plainly or under the attacker's key, are ignored, and the two honest peers meet."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.p2p import P2P

    from dtnode.peers.identity import identity_key

    dhts, validators = [], []
    for name in ("victim", "honest", "attacker"):
        path = tmp_path / f"{name}.key"
        P2P.generate_identity(str(path))
        validators.append(RSASignatureValidator(identity_key(path)))
        dhts.append(
            ready_dht(
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=[str(a) for a in dhts[0].get_visible_maddrs()] if dhts else [],
                identity_path=str(path),
                record_validators=[validators[-1]],
            )
        )
    try:

        async def main():
            victim, honest, attacker = (
                Matchmaker(dht, "mm-signed", _member(str(dht.peer_id)), poll_interval=0.05, owner=v.local_public_key)
                for dht, v in zip(dhts, validators)
            )
            key = victim.group_key(0, 0)
            lie = {"members": [victim.own.peer_id], "complete": True, "resync": False, "auth": ""}
            for purpose in ("closed", "formed"):
                for subkey in (victim.own.peer_id, victim.own.peer_id.encode() + validators[2].local_public_key):
                    await attacker.dht.store(
                        f"{key}.{purpose}",
                        subkey=subkey,
                        value=lie,
                        expiration_time=get_dht_time() + 60,
                        return_future=True,
                    )
            fake = Registration(grpc_addr="6.6.6.6:1")
            await attacker.dht.store(  # a registration in the honest peer's name
                key,
                subkey=honest.own.peer_id,
                value=fake.model_dump(),
                expiration_time=get_dht_time() + 60,
                return_future=True,
            )
            pair = {victim.own.peer_id, honest.own.peer_id}

            async def expected():
                return pair

            groups = await asyncio.gather(
                *(m.form_group(0, 0, expected, window=10, target_size=2) for m in (victim, honest))
            )
            for group in groups:
                assert {m.peer_id for m in group.members} == pair
                assert {m.grpc_addr for m in group.members} == {victim.own.grpc_addr, honest.own.grpc_addr}
            assert set(await victim.formed(key)) <= pair  # the attacker's lists are no one's

        asyncio.run(main())
    finally:
        for dht in reversed(dhts):
            dht.shutdown()


def test_a_resync_is_asked_by_any_member_or_found_by_differing_hashes_and_skipped_when_theta_is_one():
    from dtnode.peers.matchmaking import needs_resync

    def reg(resync: bool, theta: str) -> Registration:
        return Registration(resync=resync, theta=theta)

    assert not needs_resync([reg(False, "a"), reg(False, "a")])  # nobody asked, one θ_g
    assert not needs_resync([reg(False, "a"), reg(False, "")])  # nobody asked, nothing differs that is known
    # nobody asked, but one member's θ_g left the swarm's (a part failed in its other group, a
    # restart from an older checkpoint): clean rounds would never bring it back
    assert needs_resync([reg(False, "a"), reg(False, "b")])
    assert needs_resync([reg(False, "a"), reg(False, "a"), reg(False, "b")])
    assert not needs_resync([reg(True, "")])  # alone: nothing to average with
    assert not needs_resync([reg(True, "a"), reg(False, "a"), reg(False, "a")])  # the average is θ_g again
    assert needs_resync([reg(True, "a"), reg(False, "b")])
    assert needs_resync([reg(False, "a"), reg(True, "")])  # a member that does not know its hash
    assert needs_resync([reg(True, "a"), reg(False, "")])


def test_a_resync_outvotes_the_members_off_a_strict_majoritys_theta():
    from dtnode.peers.forming import outvoted

    def regs(*thetas: str) -> dict[str, Registration]:
        return {f"p{i}": Registration(theta=t) for i, t in enumerate(thetas)}

    assert outvoted(regs("a", "a", "b")) == {"p2"}
    assert outvoted(regs("a", "a", "")) == {"p2"}  # an unknown hash is not the majority's
    assert outvoted(regs("a", "b", "a", "c", "a")) == {"p1", "p3"}
    assert outvoted(regs("a", "b")) == frozenset()  # a pair that disagrees: nobody is outvoted
    assert outvoted(regs("a", "a", "b", "b")) == frozenset()  # two halves
    assert outvoted(regs("a", "", "")) == frozenset()  # one vote of three is no majority
    assert outvoted(regs("", "", "")) == frozenset()
    assert outvoted(regs("a", "a", "a")) == frozenset()


def test_a_member_knows_its_theta_after_a_resync_only_where_a_majority_reached_every_part():
    """After a re-sync a member announces, in its next hop, the hash of the θ_g it was left with
    where the group knows it (`took_majority`): a strict majority announced it and every part
    took a majority member's values. Otherwise it announces none, and its next groups re-sync
    again (a part that failed kept each member's own values; one only outvoted members reached
    is their mean)."""
    from dtnode.peers.allreduce_report import AllReduceReport, PartOutcome
    from dtnode.peers.forming import FormedGroup
    from dtnode.peers.group_reduce import took_majority

    group = FormedGroup("k", [], 3, 0.1, outvoted=("p2",), majority_theta="a" * 64)

    def parts(*outcomes: tuple[bool, list[str]]) -> AllReduceReport:
        return AllReduceReport([PartOutcome(i, f"p{i}", ok, included) for i, (ok, included) in enumerate(outcomes)])

    assert took_majority(parts((True, ["p0", "p1", "p2"]), (True, ["p0", "p1", "p2"]), (True, ["p2", "p1"])), group)
    assert not took_majority(parts((True, ["p0", "p1", "p2"]), (False, [])), group)  # a failed part
    assert not took_majority(parts((True, ["p0", "p1"]), (True, ["p2"])), group)  # only the outvoted one there
    assert not took_majority(parts((True, ["p0", "p1"])), FormedGroup("k", [], 2, 0.1))  # no majority


@pytest.mark.parametrize(
    ("size", "same_theta"), [(3, True), (3, False), (2, False)], ids=["same-theta", "outvoted", "pair"]
)
def test_a_joiner_asking_for_a_resync_moves_only_theta_that_differs(dht, size, same_theta, monkeypatch):
    """A download asks the next groups to re-sync θ_g in fp32 (8 bytes per parameter each way).
    Among members that announce the same θ_g hash the re-sync is skipped (its result would be
    that θ_g), and no θ is even read; when one member's differs, every member gets one result,
    written over the state it read: no second buffer of θ's size (8 bytes per parameter on a
    node whose memory is mostly θ_g and the momentum). Where the others hold one θ_g (a strict
    majority of the group announces its hash) that result is theirs: the member that differs
    is silent there: the majority's θ_g bit for bit; in a pair nobody is outvoted, and the pair
    takes the mean."""
    from allreduce_harness import start_peers, stop_peers

    numel = 2000
    theta_sized = []
    empty_like = torch.empty_like

    def counted(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if t.numel() == 2 * numel:
            theta_sized.append(t.numel())
        return empty_like(t, *args, **kwargs)

    monkeypatch.setattr(torch, "empty_like", counted)
    run_id = f"resync-{size}-{same_theta}"

    async def main():
        peers = await start_peers(size, run_id=run_id)
        ids = [p.member.peer_id for p in peers]
        thetas = [torch.ones(2 * numel) * (1.0 if same_theta or i else 4.0) for i in range(size)]
        given: dict[int, torch.Tensor] = {}
        hashes = ["h" * 64 if same_theta or i else "j" * 64 for i in range(size)]
        read = []

        async def view():
            return {p: PeerRecord(peer_id=p, state="averaging", model_hash="m", outer_step=0) for p in ids}

        async def run(i: int, peer):
            averager = _int8_averager(dht, run_id, peer, view)

            async def state() -> torch.Tensor:
                read.append(ids[i])
                given[i] = thetas[i].clone()
                return given[i]

            delta = torch.randn(numel, generator=torch.Generator().manual_seed(i))
            return await averager.average(0, delta, 1.0, i == 0, state, theta_sha256=hashes[i])

        try:
            results = await asyncio.gather(*(run(i, p) for i, p in enumerate(peers)))
        finally:
            await stop_peers(peers)
        for result in results:
            assert result.clean and result.hops[0].group_size == size
        if same_theta:
            assert read == [] and all(r.theta is None and r.hops[0].theta_resync_s is None for r in results)
        else:
            assert sorted(read) == sorted(ids)
            expected = 1.0 if size > 2 else (1.0 + 4.0) / 2  # outvoted: the others' θ_g; a pair: the mean
            for i, result in enumerate(results):
                assert result.theta is given[i]
                assert torch.equal(result.theta, torch.full((2 * numel,), expected))  # one θ_g, bit for bit
        assert theta_sized == []

    asyncio.run(main())


def test_a_member_off_the_swarms_theta_leaves_its_group_on_the_swarms_bits_and_later_hops_skip_the_resync(dht):
    """9 peers in a grid of two hops; one holds another θ_g (a restart from an older
    checkpoint) and says so only by its hash. Its hop-0 group re-syncs, outvotes it and leaves
    with the others' θ_g bit for bit; every member of that group then knows its hash again and
    announces it in hop 1, whose groups all hold one θ_g and re-sync nothing. Before, the group
    left with a θ_g an ulp off in many coordinates (the outvoted member counted 2^-20 of its
    share), announced no hash, and every hop-1 group it reached re-synced again: 8 bytes per
    parameter each way, to end on a θ_g that no node had held."""
    from allreduce_harness import start_peers, stop_peers

    numel, ids = 3000, [f"peer{i:02d}" for i in range(9)]
    side, dims = grid_shape(len(ids), 4)
    assert dims == 2

    def cell_of_three(run_id: str) -> set[str] | None:
        return next((c for c in cells(ids, 0, side, dims, salt=run_id).values() if 3 <= len(c) <= 4), None)

    # a run whose grid puts 3 or 4 peers in one cell of hop 0: the one off the swarm's θ_g sits
    # there, in a group whose strict majority holds the swarm's
    run_id = next(r for r in (f"off-theta-{i}" for i in range(100)) if cell_of_three(r))
    cell = cell_of_three(run_id)
    assert cell is not None
    off = min(cell)
    gen = torch.Generator().manual_seed(9)
    swarm_theta = torch.randn(numel, generator=gen) * 0.02
    older = swarm_theta + torch.randn(numel, generator=gen) * 1e-3

    async def main():
        peers = await start_peers(9, run_id=run_id)
        assert [p.member.peer_id for p in peers] == ids
        given: dict[str, torch.Tensor] = {}

        async def view():
            return {p: PeerRecord(peer_id=p, state="averaging", model_hash="m", outer_step=0) for p in ids}

        async def run(peer):
            me = peer.member.peer_id
            averager = _int8_averager(dht, run_id, peer, view)

            async def state() -> torch.Tensor:
                given[me] = (older if me == off else swarm_theta).clone()
                return given[me]

            delta = torch.randn(numel, generator=torch.Generator().manual_seed(len(me)))
            return await averager.average(0, delta, 1.0, False, state, theta_sha256="o" * 64 if me == off else "s" * 64)

        try:
            results = dict(zip(ids, await asyncio.gather(*(run(p) for p in peers))))
        finally:
            await stop_peers(peers)
        assert all(r.clean for r in results.values())
        resynced = {p for p, r in results.items() if r.theta is not None}
        assert resynced == cell
        for p in resynced:
            assert torch.equal(results[p].theta, swarm_theta)  # the swarm's bits, the one off them included
        assert all(r.hops[1].theta_resync_s is None for r in results.values())  # one θ_g in every hop-1 group

    asyncio.run(main())


def test_an_average_past_its_bound_is_an_averaging_timeout_and_an_inner_timeout_stays_itself():
    """`within_bound`: the expiry of the node's bound surfaces as AveragingTimeout (a known cause,
    logged without a traceback; it once escaped as a bare TimeoutError); a TimeoutError of the
    work's own passes through; work within the bound returns."""

    async def never() -> None:
        await asyncio.sleep(3600)

    async def own_timeout() -> None:
        raise TimeoutError("a part's own deadline")

    with pytest.raises(AveragingTimeout, match="round 7: averaging took longer than this node's bound of 0s"):
        asyncio.run(within_bound(never(), 0.05, "round 7: averaging"))
    with pytest.raises(TimeoutError, match="a part's own deadline"):
        asyncio.run(within_bound(own_timeout(), 5.0, "round 7: averaging"))
    asyncio.run(within_bound(asyncio.sleep(0.01), 5.0, "round 7: averaging"))


def test_a_hop_0_closed_without_a_late_leader_counts_whole_once_that_leader_formed_in_its_cell(dht):
    """Issue 60, 32 nodes on 2 cores: the followers of a hop-0 cell passed over a leader whose
    list came late (its host was loaded) and met without it, and the leader formed a group of the
    same key: its share went on to hop 1 there, as a split cell's does, and every node held one
    θ_g, yet the followers' rounds counted `partial` (and re-synced θ_g the next round). Once the
    hops are over, a node whose hop-0 group lacked peers of its cell reads the key's `formed`
    records: where each of them formed a group there, the hop counts whole. One that formed
    nowhere keeps it not whole."""
    from allreduce_harness import start_peers, stop_peers

    from dtnode.peers.averager import HopReport

    async def main():
        run_id = "late-leader-run"
        peers = await start_peers(1, run_id=run_id)
        me = peers[0].member.peer_id
        slot = Slot("0", 1.0, True, (0, 0))
        key = Matchmaker(dht, run_id, _member("any")).group_key(0, 0, f"d2.{slot.key}")
        ranked = by_rank(key, [f"other{i}" for i in range(64)])
        leader, mate = ranked[0], ranked[-1]
        assert by_rank(key, [me, mate, leader])[0] == leader  # it leads the cell (leadership.by_rank)
        cell = {me, mate, leader}

        async def view():
            return {p: PeerRecord(peer_id=p, state="averaging", model_hash="m", outer_step=0) for p in cell}

        averager = _int8_averager(dht, run_id, peers[0], view)
        makers = {p: Matchmaker(dht, run_id, _member(p), poll_interval=0.05, settle_s=0.3) for p in (mate, leader)}

        async def want():
            return set(cell)

        try:
            await _register(makers[leader], key)  # it registers, and its list comes too late
            own, mates = await asyncio.gather(
                averager.expect.form(0, 0, 2, 2, slot, {slot.key: cell}, window=0.5, resync=False),
                makers[mate].form_group(0, 0, want, window=0.5, target_size=4, cell=f"d2.{slot.key}"),
            )
            assert {m.peer_id for m in own.members} == {me, mate} == {m.peer_id for m in mates.members}
            assert not own.complete
            report = HopReport(0, own.key, 2, 3, 3, own.complete, [me, mate], 0.0, 0.5)
            await averager.hop0_whole_beside(0, report)
            assert not report.complete and report.expected == 3  # the leader formed nowhere yet
            await makers[leader].board.publish(key, "formed", (leader,))  # alone, in the same key
            await averager.hop0_whole_beside(0, report)
            assert report.complete and report.expected == 2 and report.formed_beside == [leader]
        finally:
            await stop_peers(peers)

    asyncio.run(main())
