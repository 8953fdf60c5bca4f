"""How long this node waits for a DHT peer's answer before it counts the peer as silent.

hivemind gives every request (a search's find, a write's store) one `wait_timeout`, 3 s. A DHT
peer that keeps its connections and answers nothing (a paused process, a frozen VM, a host
black-holed by a firewall) costs each read that asks it those 3 s, and each write twice as much
(its search, then its write), until hivemind bans it (5 s, doubling each time it is silent
again) and drops it from the routing table. In a small swarm every key lives on every peer, so
every request asks it: a membership read, a group registration, the lists that close a group.

What the answers take is measured instead, as TCP times its retransmissions (RFC 6298): the
wait is a few times the slowest recent answers (`ANSWER_FACTOR` times the 95th percentile of
the last `SAMPLES`), never under `FLOOR_S` nor over hivemind's own 3 s. On a loopback swarm
whose answers come in milliseconds a silent peer costs a read 1 s, not 3; on a loaded box whose
answers take seconds, nothing changes. An answer that never came would never be measured, and a
swarm that slowed down all at once would be given up on at every request: a wait that ran out
counts as an answer that took the whole wait (a censored sample). One silent peer among many
answers moves nothing; a few in the last `SAMPLES` put the 95th percentile at the wait, and the
next wait at the ceiling, until answers replace them.

A live peer given up on too early costs little: hivemind skips it for a few seconds and asks
the key's other replicas (`dht_requests.REPLICAS`), and the next request that reaches it puts
it back in the routing table.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any, Protocol

ANSWER_FACTOR = 4.0  # the wait, in slowest recent answers (the 95th percentile)
PERCENTILE = 0.95
SAMPLES = 64  # answered requests the percentile is taken over
MIN_SAMPLES = 8  # fewer than this, and the wait is hivemind's own (a node that has just started)
FLOOR_S = 1.0  # never less: a loaded host's loop stalls for hundreds of milliseconds at times
TIMED_OUT_SHARE = 0.9  # a failure this far into its wait ran it out (not a refusal)


class DhtCall(StrEnum):
    """The requests timed here: the two every read and write of the swarm's records make."""

    FIND = "find"  # a step of a read's search, or of a write's search for the nearest peers
    STORE = "store"  # a write to one of the nearest peers


# one DHT node per process: a process-wide count, as a metric of the process is (present at zero)
UNANSWERED: Counter[str] = Counter(dict.fromkeys(DhtCall, 0))


class TimedProtocol(Protocol):
    """The part of hivemind's DHTProtocol timed here (`wait_timeout` is read at each request)."""

    wait_timeout: float
    call_find: Callable[..., Awaitable[Any]]
    call_store: Callable[..., Awaitable[Any]]


class AnswerPatience:
    """The wait for one answer, from what answers have taken (see the module's docstring)."""

    def __init__(self, ceiling_s: float):
        self.ceiling_s = ceiling_s
        self._answers: deque[float] = deque(maxlen=SAMPLES)  # seconds; a wait run out counts as its length

    def wait_s(self) -> float:
        """How long the next request waits for its answer."""
        if len(self._answers) < MIN_SAMPLES:
            return self.ceiling_s
        ordered = sorted(self._answers)
        slowest = ordered[min(len(ordered) - 1, int(PERCENTILE * len(ordered)))]
        return min(self.ceiling_s, max(FLOOR_S, ANSWER_FACTOR * slowest))

    def answered(self, seconds: float) -> None:
        self._answers.append(seconds)

    def unanswered(self, waited_s: float, took_s: float) -> None:
        """A request that failed after `took_s` of a wait of `waited_s`: one that ran out its wait
        counts as an answer that took all of it; one refused at once (a peer gone, its port
        closed) says nothing of how long answers take."""
        if took_s >= TIMED_OUT_SHARE * waited_s:
            self._answers.append(waited_s)


def time_answers(protocol: TimedProtocol, patience: AnswerPatience) -> None:
    """Wrap `protocol`'s find and store requests so that each is timed, and each sets the wait
    of the next from `patience` (hivemind reads `wait_timeout` when it sends a request)."""
    protocol.wait_timeout = patience.wait_s()
    for call, name in ((DhtCall.FIND, "call_find"), (DhtCall.STORE, "call_store")):
        setattr(protocol, name, _timed(protocol, getattr(protocol, name), call, patience))


def _timed(
    protocol: TimedProtocol, request: Callable[..., Awaitable[Any]], call: DhtCall, patience: AnswerPatience
) -> Callable[..., Awaitable[Any]]:
    async def timed_request(*args: Any, **kwargs: Any) -> Any:
        waited = protocol.wait_timeout
        started = time.monotonic()
        result = await request(*args, **kwargs)
        took = time.monotonic() - started
        # hivemind returns None for a request that failed (timed out, or the peer unreachable)
        if result is None:
            UNANSWERED[call] += 1
            patience.unanswered(waited, took)
        else:
            patience.answered(took)
        protocol.wait_timeout = patience.wait_s()
        return result

    return timed_request


__all__ = ["UNANSWERED", "AnswerPatience", "DhtCall", "time_answers"]
