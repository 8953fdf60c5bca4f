"""How often a node reads the swarm's membership from the DHT (issue 60): every read brings
all n records back, so matchmaking's polls share one read for up to MATCHMAKING_VIEW_S, and a
node's own heartbeat does not force a read to see itself."""

from __future__ import annotations

import asyncio
import time

from dht_harness import signed_dhts

from dtnode.peers import dht_requests
from dtnode.peers.dht_requests import DhtKey, DhtOp
from dtnode.peers.membership import MATCHMAKING_VIEW_S, VIEW_REUSE_S, Membership, PeerRecord


def _reads() -> int:
    return dht_requests.REQUESTS[(DhtOp.GET, DhtKey.MEMBERSHIP)]


def test_matchmaking_shares_a_view_and_a_heartbeat_shows_itself_without_a_read(tmp_path):
    async def main():
        nodes = await signed_dhts(tmp_path, ("a", "b"))
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
                dht.shutdown()

    asyncio.run(main())
