"""The DHT requests of this node that another peer left unanswered: what a silent peer costs.

hivemind gives every request (a search's find, a write's store) one `wait_timeout`, 3 s. A DHT
peer that keeps its connections and answers nothing (a paused process, a frozen VM, a host
black-holed by a firewall) costs each read that asks it those 3 s, and each write twice as much
(its search, then its write), until hivemind bans it (5 s, doubling each time it is silent
again) and drops it from the routing table. In a small swarm every key lives on every peer, so
every request asks it. `dtnode_dht_unanswered_total{call}` counts those requests, from the
node's side, so that an operator sees a silent peer before its record lapses, and the scale
bench sees how often a loaded swarm's peers miss the wait.

The wait itself stays hivemind's. A wait set from what answers take (4 times their 95th
percentile, at least 1 s, as TCP times its retransmissions) cut a silent peer's cost from 6 s to
2 s a write, but at 32 nodes on 2 cores it gave up on live peers 0.3 to 1 time per node per
round, where the 3 s wait gave up on none (docs/results/scale.md), and hivemind drops a peer it
gave up on from its routing table.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any, Protocol


class DhtCall(StrEnum):
    """The requests counted here: the two every read and write of the swarm's records make."""

    FIND = "find"  # a step of a read's search, or of a write's search for the nearest peers
    STORE = "store"  # a write to one of the nearest peers


# one DHT node per process: a process-wide count, as a metric of the process is (present at zero)
UNANSWERED: Counter[str] = Counter(dict.fromkeys(DhtCall, 0))


class RequestingProtocol(Protocol):
    """The part of hivemind's DHTProtocol counted here."""

    call_find: Callable[..., Awaitable[Any]]
    call_store: Callable[..., Awaitable[Any]]


def count_unanswered(protocol: RequestingProtocol) -> None:
    """Wrap `protocol`'s find and store requests so that each one that fails is counted."""
    for call, name in ((DhtCall.FIND, "call_find"), (DhtCall.STORE, "call_store")):
        setattr(protocol, name, _counted(getattr(protocol, name), call))


def _counted(request: Callable[..., Awaitable[Any]], call: DhtCall) -> Callable[..., Awaitable[Any]]:
    async def counted_request(*args: Any, **kwargs: Any) -> Any:
        result = await request(*args, **kwargs)
        if result is None:  # hivemind's answer for a request that failed (timed out, or refused)
            UNANSWERED[call] += 1
        return result

    return counted_request


__all__ = ["UNANSWERED", "DhtCall", "count_unanswered"]
