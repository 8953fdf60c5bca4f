"""Moshpit grid and matchmaking: exact mean on full grids, agreement without a leader."""

import asyncio
import time
from collections import Counter

import hivemind
from hivemind.utils import get_dht_time
import pytest
import torch

from dtnode.peers.deadlines import AdaptiveDeadlines, expected_payload_bytes
from dtnode.peers.grid import (
    classes_of, coordinates, expected_groups, first_slot, grid_shape, hop_key, next_slots, split_groups,
)
from dtnode.peers.matchmaking import Matchmaker
from dtnode.peers.plan import Member


@pytest.mark.parametrize("n,m,d", [(9, 3, 2), (16, 4, 2), (64, 4, 3), (8, 2, 3), (5, 16, 1), (17, 16, 2)])
def test_grid_shape(n, m, d):
    assert grid_shape(n, m) == (m, d)


def _average_over_grid(ids: list[str], step: int, side: int, dims: int, target: int, values: dict, weights: dict):
    """Run the grid's hops as the averager does, every group forming exactly as planned."""
    coords = {p: coordinates(p, step, side, dims) for p in ids}
    slots = {p: [first_slot(coords[p])] for p in ids}
    for hop in range(dims):
        by_key: dict[str, list[tuple[str, float]]] = {}
        for p, own in slots.items():
            for slot in own:
                by_key.setdefault(slot.key, []).append((p, slot.share))
        results, groups = {}, {}
        for key, joined in by_key.items():
            share = dict(joined)
            for group in (split_groups(share, target) if hop == 0 else [sorted(share)]):
                total = sum(weights[p] * share[p] for p in group)
                mean = sum(weights[p] * share[p] * values[p] for p in group) / total
                for p in group:
                    if slots[p][0].key == key:  # the primary slot's result is carried on
                        results[p], groups[p] = (mean, total), group
        for p in ids:
            values[p], weights[p] = results[p]
        if hop + 1 < dims:
            slots = {p: next_slots(slots[p][0].coords, hop + 1, groups[p], p, side) for p in ids}


@pytest.mark.parametrize("n,m", [(9, 3), (12, 4), (6, 3), (16, 4), (5, 4), (4, 4), (30, 16)])
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
    expects the same cells as the full view for everyone else, hop 0 and hop 1 alike."""
    ids = [f"p{i}" for i in range(12)]
    full = expected_groups(ids, 5, 4, 2, 4)
    for missing in ids:
        skewed = expected_groups([p for p in ids if p != missing], 5, 4, 2, 4)
        own_cell = next(k for k, members in full[0].items() if missing in members)
        for key, members in full[0].items():
            assert skewed[0].get(key, set()) == members - {missing}, (missing, key)
            assert key == own_cell or missing not in members
    assert coordinates("p1", 3, 3, 2) != coordinates("p1", 4, 3, 2) or coordinates("p1", 5, 3, 2) != \
        coordinates("p1", 3, 3, 2)  # cells reshuffle with the step
    assert hop_key((1, 2), 0) == "2" and hop_key((1, 2), 1) == "1" and hop_key((5,), 0) == "all"


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
    assert expected_payload_bytes(1000, 1, True, 256) == 0
    assert expected_payload_bytes(1000, 2, False, 256) == 4000


@pytest.fixture(scope="module")
def dht():
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


def _member(name: str) -> Member:
    return Member(name, f"127.0.0.1:{abs(hash(name)) % 50000 + 1000}")


def test_two_cells_form_their_own_groups(dht):
    async def main():
        makers = {p: Matchmaker(dht, "mm-cells", _member(p), poll_interval=0.05) for p in "abcd"}
        cell = {"a": "x", "b": "x", "c": "y", "d": "y"}
        expected = {"x": {"a", "b"}, "y": {"c", "d"}}

        async def form(p):
            async def want():
                return expected[cell[p]]
            return await makers[p].form_group(0, 1, want, window=10, target_size=4, cell=cell[p])
        started = time.monotonic()
        groups = await asyncio.gather(*(form(p) for p in "abcd"))
        assert time.monotonic() - started < 5  # closed as soon as complete, not by the window
        for p, g in zip("abcd", groups):
            assert sorted(m.peer_id for m in g.members) == sorted(expected[cell[p]])
            assert g.complete and g.key.endswith(f".1.{cell[p]}")
    asyncio.run(main())


def test_a_member_with_a_divergent_view_costs_one_hop_never_a_corrupt_group(dht):
    """c closes its group as [b, c] (it never saw a) while a and b expect [a, b, c]. Nobody
    averages with a member that disagrees on the group (depending on timing a and b pair up
    or each average alone), and nobody waits past the window plus the confirmation timeout."""
    async def main():
        makers = {p: Matchmaker(dht, "mm-diverge", _member(p), poll_interval=0.05) for p in "abc"}

        async def want():
            return {"a", "b", "c"}

        async def divergent_c():
            key = makers["c"].group_key(0, 0, "all")
            await makers["c"].dht.store(key, subkey="c", value={"grpc_addr": _member("c").grpc_addr},
                                        expiration_time=get_dht_time() + 60, return_future=True)
            members = [_member("b"), _member("c")]
            return await makers["c"]._confirm(key, ("b", "c"), members, timeout=3.0)

        started = time.monotonic()
        a, b, c = await asyncio.gather(
            makers["a"].form_group(0, 0, want, window=5, target_size=3),
            makers["b"].form_group(0, 0, want, window=5, target_size=3),
            divergent_c())
        assert time.monotonic() - started < 5 + 3 + 2
        groups = {"a": [m.peer_id for m in a.members], "b": [m.peer_id for m in b.members],
                  "c": [m.peer_id for m in c]}
        assert groups["c"] == ["c"]  # its list disagrees with a's: it leaves the hop for itself
        for p, members in groups.items():
            assert "c" not in members or p == "c"
            for q in members:  # whoever averages together agrees on the whole group
                assert groups[q] == members, groups
    asyncio.run(main())
