"""The node's DHT on its own loop (peers/dht_in_process.py): no process forked for it, p2pd its
only child, and a start that fails stops the p2pd it started, so a joiner that dials again and
again (until --join-timeout) leaves no daemons behind."""

import asyncio

import psutil
import pytest

from dtnode.peers.dht_start import start_dht
from dtnode.peers.hivemind_adapter import get_dht_time
from dtnode.peers.membership import JoinError


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE]


def test_the_dht_runs_in_this_process_and_a_failed_start_leaves_no_daemon():
    async def scenario() -> None:
        before = {p.pid for p in _children()}
        first = await start_dht([], "127.0.0.1", 0, None, timeout=30)
        try:
            started = [p for p in _children() if p.pid not in before]
            # one p2pd, exec'd: nothing forked that runs this interpreter
            assert [p.name() for p in started] == ["p2pd"], [p.cmdline() for p in started]
            assert first.get_visible_maddrs() and str(first.peer_id)
            assert await first.store("k", "v", expiration_time=get_dht_time() + 60, return_future=True)
            found = await first.get("k", latest=True, return_future=True)
            assert found is not None and found.value == "v"
            gone = [str(a) for a in first.get_visible_maddrs()]
        finally:
            await first.shutdown()
        assert not [p for p in _children() if p.pid not in before]  # its p2pd stopped with it

        # the address of a DHT that is gone: no answer; the daemon started for the try is stopped
        with pytest.raises(JoinError):
            await start_dht(gone, "127.0.0.1", 0, None, timeout=5, keep_trying=False)
        assert not [p for p in _children() if p.pid not in before]

    asyncio.run(scenario())


def test_a_daemon_that_started_but_whose_start_failed_after_is_stopped(monkeypatch: pytest.MonkeyPatch):
    """hivemind's `P2P.create` can fail after p2pd printed its peer id (its first ping unanswered)
    without returning the object that owns the daemon: the start stops that daemon all the same."""
    from hivemind.p2p import p2p_daemon

    async def unanswered(self: object) -> None:
        raise p2p_daemon.P2PDaemonError("the daemon's first ping went unanswered")

    monkeypatch.setattr(p2p_daemon.P2P, "_ping_daemon", unanswered)

    async def scenario() -> None:
        before = {p.pid for p in _children()}
        with pytest.raises(JoinError, match="first ping went unanswered"):
            await start_dht([], "127.0.0.1", 0, None, timeout=10)
        assert not [p for p in _children() if p.pid not in before]

    asyncio.run(scenario())
