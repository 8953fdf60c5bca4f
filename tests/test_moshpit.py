"""Moshpit grid and matchmaking: exact mean on full grids, agreement without a leader."""

import asyncio
import time

import hivemind
from hivemind.utils import get_dht_time
import pytest
import torch

from dtnode.peers.deadlines import AdaptiveDeadlines, expected_payload_bytes
from dtnode.peers.grid import coordinates, grid_shape, hop_groups, hop_key
from dtnode.peers.matchmaking import Matchmaker
from dtnode.peers.plan import Member


@pytest.mark.parametrize("n,m,d", [(9, 3, 2), (16, 4, 2), (64, 4, 3), (8, 2, 3), (5, 16, 1), (17, 16, 2)])
def test_grid_shape(n, m, d):
    assert grid_shape(n, m) == (m, d)


@pytest.mark.parametrize("n,m", [(9, 3), (16, 2), (64, 4), (27, 3), (12, 4), (6, 3)])
def test_full_grid_reaches_the_exact_weighted_mean_in_d_hops(n, m):
    """Averaging the (mean, weight) pair hop by hop gives every peer the exact weighted mean."""
    side, dims = grid_shape(n, m)
    ids = [f"p{i}" for i in range(n)]
    coords = coordinates(ids, 7, side, dims)
    values = {p: torch.randn(32, dtype=torch.float64) for p in ids}
    weights = {p: float(i + 1) for i, p in enumerate(ids)}
    exact = sum(weights[p] * values[p] for p in ids) / sum(weights.values())
    for hop in range(dims):
        for members in hop_groups(coords, hop).values():
            assert len(members) <= side
            total = sum(weights[p] for p in members)
            mean = sum(weights[p] * values[p] for p in members) / total
            for p in members:
                values[p], weights[p] = mean.clone(), total
    if n == side ** dims or n % side == 0:  # full rows: exact
        for p in ids:
            torch.testing.assert_close(values[p], exact)


def test_coordinates_agree_between_peers_and_reshuffle_every_step():
    ids = [f"p{i}" for i in range(9)]
    assert coordinates(ids, 3, 3, 2) == coordinates(list(reversed(ids)), 3, 3, 2)
    assert coordinates(ids, 3, 3, 2) != coordinates(ids, 4, 3, 2)
    assert sorted(coordinates(ids, 3, 3, 2).values()) == [(a, b) for b in range(3) for a in range(3)][:9] or \
        len(set(coordinates(ids, 3, 3, 2).values())) == 9
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
