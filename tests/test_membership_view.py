"""How often a node reads the swarm's membership from the DHT (issue 60): every read brings
all n records back, so matchmaking's polls share one read for up to MATCHMAKING_VIEW_S, and a
node's own heartbeat does not force a read to see itself."""

from __future__ import annotations

import asyncio
import time
from functools import partial

from dht_harness import freezable_dht, run_in_fresh_process, shut_down, signed_dhts, sigstopped

from dtnode.peers import dht_requests
from dtnode.peers.dht_requests import DhtKey, DhtOp
from dtnode.peers.hivemind_adapter import DHTID, get_dht_time
from dtnode.peers.membership import (
    DIRECT_STORES_PER_SEARCH,
    MATCHMAKING_VIEW_S,
    VIEW_REUSE_S,
    Membership,
    PeerRecord,
)
from dtnode.peers.near_store import store_near


def _reads() -> int:
    return dht_requests.REQUESTS[(DhtOp.GET, DhtKey.MEMBERSHIP)]


def test_matchmaking_shares_a_view_and_a_heartbeat_shows_itself_without_a_read(tmp_path):
    run_in_fresh_process(tmp_path, shared_view_scenario)


async def shared_view_scenario(folder):
    """The scenario of the test above, in a process of its own (dht_harness.run_in_fresh_process)."""
    nodes = await signed_dhts(folder, ("a", "b"))
    try:
        a, b = (Membership(dht, "viewed", 60, 1, validator) for dht, validator in nodes)
        assert await a.announce(PeerRecord(peer_id=a.peer_id, grpc_addr="127.0.0.1:1", state="training"))
        assert await b.announce(PeerRecord(peer_id=b.peer_id, grpc_addr="127.0.0.1:2", state="training"))
        before, read_at = _reads(), time.monotonic()
        assert set(await a.members()) == {a.peer_id, b.peer_id}
        assert _reads() == before + 1

        # a's next heartbeat changes its own record: its view shows it at once, unread
        await a.announce(PeerRecord(peer_id=a.peer_id, grpc_addr="127.0.0.1:1", state="averaging", outer_step=3))
        polls = 0
        while time.monotonic() - read_at < MATCHMAKING_VIEW_S * 0.8:
            view = await a.recent_members()
            assert view[a.peer_id].state == "averaging" and view[a.peer_id].outer_step == 3
            polls += 1
            await asyncio.sleep(0.05)
        assert polls >= 5 and _reads() == before + 1  # every matchmaking poll shared the one read

        # b moves on; a caller that needs the view now (older than VIEW_REUSE_S) reads it
        await b.announce(PeerRecord(peer_id=b.peer_id, grpc_addr="127.0.0.1:2", state="averaging", outer_step=3))
        await asyncio.sleep(VIEW_REUSE_S)
        assert (await a.members())[b.peer_id].outer_step == 3
        assert _reads() == before + 2
        # and one past MATCHMAKING_VIEW_S reads again from a matchmaking poll too
        await asyncio.sleep(MATCHMAKING_VIEW_S)
        await a.recent_members()
        assert _reads() == before + 3
    finally:
        for dht, _ in reversed(nodes):
            await dht.shutdown()


def test_a_wait_for_peers_polls_less_often_while_their_count_stands_still(tmp_path):
    """A node waiting for --min-peers reads the membership every `poll` while peers arrive and
    WAIT_POLL_BACKOFF times less often while their count stands still (each read brings every
    record back: issue 60's idle cost); a peer that becomes ready is still counted, and a wait
    that runs out returns those ready."""
    run_in_fresh_process(tmp_path, waiting_scenario)


async def waiting_scenario(folder):
    """The scenario of the test above, in a process of its own (dht_harness.run_in_fresh_process)."""
    nodes = await signed_dhts(folder, ("a", "b"))
    try:
        a, b = (Membership(dht, "waiting", 60, 1, validator) for dht, validator in nodes)
        assert await a.announce(PeerRecord(peer_id=a.peer_id, grpc_addr="127.0.0.1:1", state="training"))
        assert await b.announce(PeerRecord(peer_id=b.peer_id, grpc_addr="127.0.0.1:2", state="syncing"))
        poll, standing = 0.1, 3.0
        before = _reads()
        view = await a.wait_for(3, standing, poll=poll)  # a third peer never comes
        assert set(view) == {a.peer_id}  # b is still syncing: not ready
        # one read, one `poll` later, then one every WAIT_POLL_BACKOFF polls (16 in 3 s at 2), where
        # a read every `poll` makes 31 (fewer only where reads take longer than a poll)
        reads = _reads() - before
        assert 2 <= reads <= 0.7 * standing / poll, reads

        async def ready_later() -> None:
            await asyncio.sleep(1.0)
            assert await b.announce(PeerRecord(peer_id=b.peer_id, grpc_addr="127.0.0.1:2", state="training"))

        later = asyncio.ensure_future(ready_later())
        view = await a.wait_for(2, 30, poll=poll)
        await later
        assert set(view) == {a.peer_id, b.peer_id}
    finally:
        for dht, _ in reversed(nodes):
            await dht.shutdown()


def test_heartbeats_and_a_records_life_stretch_with_the_swarm_above_eight_peers(tmp_path):
    """Each heartbeat's store brings every record back from each node it asks, so above
    FULL_RATE_PEERS peers a node beats n/8 times less often and its record lives as much longer
    (`Membership.beat_s`): what it moves per second stays flat as the swarm grows. The record it
    stores carries that longer life in the DHT, where every reader sees it."""
    run_in_fresh_process(tmp_path, stretched_life_scenario)


async def stretched_life_scenario(folder):
    """The scenario of the test above, in a process of its own (dht_harness.run_in_fresh_process)."""
    nodes = await signed_dhts(folder, ("a",))
    try:
        ((dht, validator),) = nodes
        a = Membership(dht, "stretched", 6.0, 2.0, validator)
        assert (a.beat_s(), a.record_ttl(), a.complete_view_s()) == (2.0, 6.0, 4.0)  # alone
        for i in range(15):  # as a read of a 16-peer swarm leaves the view
            a._records[f"peer-{i}"] = (time.time() + 60, PeerRecord(peer_id=f"peer-{i}"))
        assert await a.announce(PeerRecord(peer_id=a.peer_id, grpc_addr="127.0.0.1:1", state="training"))
        assert (a.beat_s(), a.record_ttl(), a.complete_view_s()) == (4.0, 12.0, 8.0)
        found = await dht.get(a.key, latest=True, return_future=True)
        (entry,) = found.value.values()
        assert 11.0 < entry.expiration_time - get_dht_time() <= 12.0
    finally:
        for node, _ in reversed(nodes):
            await node.shutdown()


def test_a_peer_that_stops_answering_drops_no_other_peer_from_the_view(tmp_path):
    """A DHT peer that holds its connections but never answers (paused, frozen, black-holed)
    makes each store that asks it wait two of hivemind's request timeouts (6 s) until it is
    evicted. Beating one store after another, the nodes near it then went 6 s without a beat,
    past their records' life: they dropped out of each other's views together, and formed their
    groups without each other (CI: a 3-peer swarm whose θ_g split over one paused peer). Beats
    go out on schedule (`Membership.heartbeat`): the two others never lose each other."""
    run_in_fresh_process(tmp_path, frozen_peer_scenario)


async def frozen_peer_scenario(folder):
    """The scenario of the test above, in a process of its own (dht_harness.run_in_fresh_process)."""
    nodes = await signed_dhts(folder, ("a", "b"))
    frozen = await freezable_dht(nodes)
    stopped = asyncio.Event()
    a, b = (Membership(dht, "frozen", 6.0, 2.0, validator) for dht, validator in nodes)  # the defaults
    beats = [
        asyncio.ensure_future(m.heartbeat(lambda m=m: PeerRecord(peer_id=m.peer_id, state="training"), stopped))
        for m in (a, b)
    ]
    try:
        deadline = time.monotonic() + 20
        while not ({a.peer_id, b.peer_id} <= set(await a.members()) and a.peer_id in await b.members()):
            assert time.monotonic() < deadline, "the two never saw each other"
            await asyncio.sleep(0.25)
        with sigstopped(frozen):
            lost: list[tuple[float, str]] = []
            frozen_at = time.monotonic()
            while time.monotonic() - frozen_at < 12:
                for reader, other, name in ((a, b, "b"), (b, a, "a")):
                    if other.peer_id not in await reader.members():
                        lost.append((round(time.monotonic() - frozen_at, 2), name))
                await asyncio.sleep(0.25)
            assert not lost, f"a peer left the other's view while a third was frozen: {lost}"
    finally:
        stopped.set()
        await asyncio.gather(*beats, return_exceptions=True)
        await shut_down(nodes, frozen)


def test_heartbeats_between_searches_go_straight_to_the_nodes_nearest_the_key(tmp_path):
    """A heartbeat's store through hivemind searches the DHT for the key's nodes, and each node
    it asks answers with every record under the key (issue 60: most of an idle swarm's CPU).
    Between searches a beat is stored on the nodes the routing table knows nearest the key
    (peers/near_store.py), without a search: the same replicas, where every reader finds it."""
    run_in_fresh_process(tmp_path, direct_store_scenario)


async def direct_store_scenario(folder):
    """The scenario of the test above, in a process of its own (dht_harness.run_in_fresh_process)."""
    nodes = await signed_dhts(folder, tuple("abcdefg"))  # the first one's table holds 6 others, above REPLICAS
    try:
        views = [Membership(dht, "direct", 60, 1, validator) for dht, validator in nodes]
        a, protocol = views[0], nodes[0][0].node.protocol
        searches: list[object] = []
        call_find = protocol.call_find

        async def counted_find(peer, keys):
            searches.append(peer)
            return await call_find(peer, keys)

        protocol.call_find = counted_find
        for beat in range(2 * (DIRECT_STORES_PER_SEARCH + 1)):
            before = len(searches)
            record = PeerRecord(peer_id=a.peer_id, grpc_addr="127.0.0.1:1", state="training", outer_step=beat)
            assert await a.announce(record)
            assert (len(searches) > before) == (beat % (DIRECT_STORES_PER_SEARCH + 1) == 0), (beat, searches)
            for reader in views[1:]:  # each reader's own search of the DHT finds the newest beat
                assert (await reader.members(max_age=0))[a.peer_id].outer_step == beat

        # the entry is on the REPLICAS nodes nearest the key, and on no other
        key_id = DHTID.generate(source=a.key)
        dht_nodes = [dht.node for dht, _ in nodes]
        nearest = sorted(dht_nodes, key=lambda n: key_id.xor_distance(n.node_id))[: dht_requests.REPLICAS]
        holding = [n for n in dht_nodes if (found := n.protocol.storage.get(key_id)) and a.subkey in found.value]
        assert {n.node_id for n in holding} == {n.node_id for n in nearest}
    finally:
        for dht, _ in reversed(nodes):
            await dht.shutdown()


def test_a_direct_heartbeat_skips_a_near_node_that_left_it_unanswered(tmp_path):
    """A node among the nearest that holds its connections and answers nothing (paused,
    frozen) costs a direct heartbeat one wait, then a spare takes its replica; it is banned as
    hivemind's searches ban it, so the next beats neither wait on it nor ask it again."""
    run_in_fresh_process(tmp_path, direct_store_past_a_frozen_node_scenario)


async def direct_store_past_a_frozen_node_scenario(folder):
    """The scenario of the test above, in a process of its own (dht_harness.run_in_fresh_process)."""
    nodes = await signed_dhts(folder, tuple("abcdef"))
    frozen = await freezable_dht(nodes)
    a_dht, validator = nodes[0]
    table = a_dht.node.protocol.routing_table
    try:
        deadline = time.monotonic() + 30
        while table.get(peer_id=frozen.peer_id) is None:
            assert time.monotonic() < deadline, "the frozen-to-be node never entered the routing table"
            await asyncio.sleep(0.2)
        frozen_id = table.get(peer_id=frozen.peer_id)
        ids = [table.get(peer_id=dht.peer_id) or dht.node.node_id for dht, _ in nodes] + [frozen_id]
        # a run whose membership key has the frozen node among its REPLICAS nearest
        run_id = next(
            f"run{i}"
            for i in range(1000)
            if frozen_id
            in sorted(ids, key=DHTID.generate(source=f"run{i}.peers").xor_distance)[: dht_requests.REPLICAS]
        )
        a = Membership(a_dht, run_id, 60, 1, validator)
        readers = [Membership(dht, run_id, 60, 1, v) for dht, v in nodes[1:]]
        asked: list[object] = []
        call_store = a_dht.node.protocol.call_store

        async def counted_store(peer, *args, **kwargs):
            asked.append(peer)
            return await call_store(peer, *args, **kwargs)

        a_dht.node.protocol.call_store = counted_store
        with sigstopped(frozen):
            for beat in range(DIRECT_STORES_PER_SEARCH):
                value = PeerRecord(peer_id=a.peer_id, grpc_addr="127.0.0.1:1", state="training", outer_step=beat)
                took = await a_dht.run_coroutine(
                    partial(store_near, a.key, a.subkey, value.model_dump(), get_dht_time() + 60, dht_requests.REPLICAS)
                )
                assert took == dht_requests.REPLICAS, (beat, took)  # a spare took the frozen node's replica
                for reader in readers:
                    assert (await reader.members(max_age=0))[a.peer_id].outer_step == beat
            assert asked.count(frozen.peer_id) == 1, asked  # asked once, then banned
    finally:
        await shut_down(nodes, frozen)
