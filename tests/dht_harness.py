"""hivemind DHTs started in a test process as a node starts its own: forked under the fork lock
and waited for with a deadline, another started if one never gets ready.

hivemind's DHT is a forked child of the (threaded) test process; once in a while one starts but
never answers its parent (seen in the suite: 300 s in `hivemind.DHT(start=True)`, which waits
without a deadline, then pytest's timeout)."""

from __future__ import annotations

from typing import Any

from hivemind import DHT

from dtnode.peers.dht_start import _forked_dht

READY_S = 30.0


def ready_dht(**kwargs: Any) -> DHT:
    """A running DHT with these hivemind.DHT arguments; AssertionError after three that never got ready."""
    for _ in range(3):
        try:
            return _forked_dht(kwargs, READY_S)
        except TimeoutError:
            continue
    raise AssertionError(f"three DHTs in a row were not ready within {READY_S:g}s")
