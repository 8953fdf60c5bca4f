"""Matchmaking beside a DHT peer that holds its connections and never answers (paused, frozen,
black-holed): the peers that still answer form their group together."""

from __future__ import annotations

import asyncio
import time

from dht_harness import freezable_dht, run_in_fresh_process, shut_down, signed_dhts, sigstopped

from dtnode.peers import dht_unanswered
from dtnode.peers.matchmaking import Matchmaker
from dtnode.peers.plan import Member

MIN_WINDOW_S = 1.0  # `--matchmaking-window-min`'s default: where the adaptive window starts


def test_two_peers_pair_while_a_third_dht_peer_is_frozen(tmp_path):
    """Each write of a registration that asks a silent DHT node waits out two of hivemind's
    request timeouts (its search, then its write: 6 s). Counted from when the registration was
    asked for, the window of both live peers had ended by then, and each averaged alone (a
    3-node swarm at its defaults, one node paused: its two others `groups 1/1` and `1/3`). The
    window runs from when the registration is out (`Matchmaker.form_group`): they pair."""
    run_in_fresh_process(tmp_path, silent_peer_pairing_scenario)


async def silent_peer_pairing_scenario(folder):
    """The scenario of the test above, in a process of its own (dht_harness.run_in_fresh_process)."""
    nodes = await signed_dhts(folder, ("a", "b"))
    frozen = await freezable_dht(nodes)
    makers = [
        Matchmaker(dht, "silent", Member(str(dht.peer_id), f"127.0.0.1:{1001 + i}"), 0.15, owner=v.local_public_key)
        for i, (dht, v) in enumerate(nodes)
    ]
    everyone = {m.own.peer_id for m in makers}

    async def both() -> set[str]:
        return set(everyone)

    async def form(round_no: int) -> list[list[str]]:
        groups = await asyncio.gather(
            *(m.form_group(round_no, 0, both, window=MIN_WINDOW_S, target_size=2) for m in makers)
        )
        return [sorted(member.peer_id for member in g.members) for g in groups]

    try:
        pair = sorted(everyone)
        assert await form(0) == [pair, pair], "the two did not pair before the third was frozen"
        with sigstopped(frozen):
            started = time.monotonic()
            groups = await form(1)
            took = time.monotonic() - started
            assert groups == [pair, pair], f"with a third DHT peer frozen, the two formed {groups} in {took:.1f}s"
            assert await form(2) == [pair, pair]
            # the requests that asked the frozen peer were counted (dtnode_dht_unanswered_total)
            assert sum(dht_unanswered.UNANSWERED.values()) > 0
    finally:
        await shut_down(nodes, frozen)
