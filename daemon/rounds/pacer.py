"""When a round ends: after H inner steps (fixed pacing), or when the swarm has processed the
round's tokens (swarm pacing, like hivemind's ProgressTracker and target batch size).

With swarm pacing every peer follows the others' published progress (`peers/pacing.py` does
the arithmetic) and moves its estimate of the round's end; between two inner steps the
training thread asks `keep_going` whether one more step still ends in time. A step that ends
before the expected end is taken; one that would straddle it is taken with the probability
of the part that fits (`left / step`), so each peer trains, in expectation, exactly the time
the round has: a fast peer more steps, a slow one fewer, and a peer k times slower 1/k of a
fast one's tokens even when its steps are longer than a round's remainder (a fixed rule,
"take it if half of it fits", is right only on average over uniform remainders; a slow peer's
remainders repeat round after round, so it was off by its whole step every round). The clock
and the random draw are injected, so tests run the pacer against fakes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable

from dtnode.peers.hivemind_adapter import get_dht_time
from dtnode.peers.membership import PeerRecord
from dtnode.peers.pacing import SwarmProgress, swarm_progress

log = logging.getLogger("dtnode")

PACER_POLL_S = 0.2  # how often a node idling until the round's end looks at the expected end again
# The swarm's progress is read from the DHT (every record, of every peer) this many heartbeats
# apart: records change once a heartbeat and at a peer's phase changes, and the end read from them
# is a time on this node's clock that holds between reads. Read every PACER_POLL_S, the pacer
# made most of a node's DHT reads (5 a second, each of all n records: n² across the swarm),
# and 32 nodes on one box spent their cores on them (tests/bench/scale.py).
READ_HEARTBEATS = 0.25
MAX_ROUND_FACTOR = 100  # a paced round takes at most this many times H steps on one peer
CLOSE_FRACTION = 0.9  # another peer's close ends the round once the swarm counts this much of its target
EXTRAPOLATE_HEARTBEATS = 1.5  # a record's count is extrapolated this many heartbeats at most

View = Callable[[], Awaitable[dict[str, PeerRecord]]]


class FixedPacer:
    """Exactly H steps per round, whatever the swarm does."""

    def __init__(self, inner_steps: int):
        self.inner_steps = inner_steps
        self.progress: SwarmProgress | None = None

    @property
    def max_steps(self) -> int:
        return self.inner_steps

    def keep_going(self, step_seconds: float) -> bool:
        return True

    def start_round(self) -> None:
        """Nothing to reset."""

    async def wait_for_end(self, at_most: float) -> None:
        """Nothing to wait for: the round ends with the H-th step."""

    async def follow(self, round_no: int) -> None:
        """Nothing to follow."""


class SwarmPacer:
    """The round ends when the swarm's published tokens reach its target."""

    def __init__(
        self,
        view: View,
        own: Callable[[], PeerRecord],
        inner_steps: int,
        round_tokens: int | None,
        closed_under_us: Callable[[dict[str, PeerRecord], int], bool] = lambda view, round_no: False,
        on_progress: Callable[[SwarmProgress], None] = lambda progress: None,
        clock: Callable[[], float] = time.monotonic,
        dht_time: Callable[[], float] = get_dht_time,
        poll_s: float = PACER_POLL_S,
        read_s: float = PACER_POLL_S,
        max_extrapolation: float = 0.0,
        draw: Callable[[], float] = random.random,
    ):
        self.view = view
        self.own = own
        self.inner_steps = inner_steps
        self.round_tokens = round_tokens
        self.closed_under_us = closed_under_us  # a joiner's round that closed before its steps were done
        self.on_progress = on_progress  # what /status shows of the round
        self.clock = clock
        self.dht_time = dht_time
        self.poll_s = poll_s
        self.read_s = read_s  # between reads of the swarm's progress (`follow`)
        self.max_extrapolation = max_extrapolation  # seconds (EXTRAPOLATE_HEARTBEATS heartbeats)
        self.draw = draw  # uniform in [0, 1): the straddling step's coin
        self.round_end_at = math.inf  # on `clock`: when the swarm's round is expected to end
        self.progress: SwarmProgress | None = None

    @property
    def max_steps(self) -> int:
        return MAX_ROUND_FACTOR * self.inner_steps

    def keep_going(self, step_seconds: float) -> bool:
        """Called by the training thread before each step: whether to take it (see the module)."""
        left = self.round_end_at - self.clock()
        if left >= step_seconds:
            return True
        if left <= 0:
            return False
        return self.draw() < left / step_seconds

    async def update(self, round_no: int) -> None:
        """Read the swarm's progress once and move the expected end."""
        view = await self.view()
        # others' records extrapolated a heartbeat and a half at most: see peers/pacing.py
        progress = swarm_progress(
            view.values(),
            self.own(),
            round_no,
            self.inner_steps,
            self.round_tokens,
            self.dht_time(),
            max_extrapolation=self.max_extrapolation,
        )
        self.progress = progress
        self.on_progress(progress)
        self.round_end_at = self.clock() + progress.seconds_left()
        if progress.closed and (progress.done >= CLOSE_FRACTION * progress.target or progress.closed_by_most):
            self.round_end_at = -math.inf  # others closed it: the swarm is averaging, not waiting for this node
        if self.closed_under_us(view, round_no):
            self.round_end_at = -math.inf  # joined in the round's last seconds: see catchup/joiner.py

    def start_round(self) -> None:
        """A new round's end is not known yet: called before its first step may ask (else the
        training thread would read the last round's end, already past, and take no step)."""
        self.round_end_at = math.inf

    async def wait_for_end(self, at_most: float) -> None:
        """After the last step (a straddling one declined, or none fitting at all): idle until the
        round's expected end, `at_most` seconds (one step), or until another peer closes it, so
        this peer reaches matchmaking with the swarm rather than a step early, where a window
        adapted to rounds that arrive together would close on it alone. `follow` keeps moving
        the end meanwhile."""
        waited_until = self.clock() + at_most
        while (now := self.clock()) < min(self.round_end_at, waited_until):
            await asyncio.sleep(min(self.poll_s, min(self.round_end_at, waited_until) - now))

    async def follow(self, round_no: int) -> None:
        """Until cancelled (when the round's inner steps end): follow the swarm's progress."""
        while True:
            try:
                await self.update(round_no)
            except Exception as e:  # noqa: BLE001  (a failed read keeps the last estimate; the next poll retries)
                log.warning("reading the swarm's progress failed: %s", e)
            await asyncio.sleep(self.read_s)


Pacer = FixedPacer | SwarmPacer
