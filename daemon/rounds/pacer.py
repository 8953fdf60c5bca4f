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

from dtnode.peers.dht_requests import poll_stretch
from dtnode.peers.hivemind_adapter import get_dht_time
from dtnode.peers.membership import PeerRecord
from dtnode.peers.pacing import SwarmProgress, swarm_progress, swarm_round_began

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
# A peer's round ends when its share's time is up (`SwarmProgress.end_in`); counted in its own
# tokens it also ends at this many times its share (`_share`), whatever its speed did meanwhile
SHARE_SLACK = 1.5
# With --round-seconds, a peer's steps end the budget after the swarm's median start of the round
# (`SwarmPacer.time_end`), and at most this far from the budget after its own start, either way:
# a peer that entered the round late by more than half a budget (or records that lie about the
# swarm's start) cuts its round to half the budget at most, and one early stretches it by half
TIME_BUDGET_RANGE = (0.5, 1.5)

View = Callable[[], Awaitable[dict[str, PeerRecord]]]


class FixedPacer:
    """Exactly H steps per round, whatever the swarm does (or fewer, when the round's time
    budget, --round-seconds, counted from this peer's own start, runs out)."""

    def __init__(
        self, inner_steps: int, round_seconds: float | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.inner_steps = inner_steps
        self.round_seconds = round_seconds
        self.clock = clock
        self.progress: SwarmProgress | None = None

    @property
    def max_steps(self) -> int:
        return self.inner_steps

    def keep_going(self, step_seconds: float) -> bool:
        return True

    def start_round(self) -> float | None:
        """The latest the round's steps may run (on `clock`): the time budget from now."""
        return self.clock() + self.round_seconds if self.round_seconds else None

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
        own_count: Callable[[], tuple[int, int]] = lambda: (0, 0),
        share_below_s: float = 0.0,
        round_seconds: float | None = None,
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
        self.read_s = read_s  # between reads of the swarm's progress (`follow`), stretched in a large swarm
        self.peers_read = 0  # records in the last read: each read brings all of them (dht_requests.poll_stretch)
        self.max_extrapolation = max_extrapolation  # seconds (EXTRAPOLATE_HEARTBEATS heartbeats)
        self.draw = draw  # uniform in [0, 1): the straddling step's coin
        # this round's tokens so far and tokens per step, read live by the training thread
        self.own_count = own_count
        self.share_tokens = math.inf  # this peer's share of the round's target, in its tokens (`_share`)
        self.share_below_s = share_below_s  # rounds expected shorter than this are paced by shares
        self.round_end_at = math.inf  # on `clock`: when the swarm's round is expected to end
        self.round_seconds = round_seconds  # the time budget of a round's steps (`time_end`)
        self.started_at = 0.0  # on `clock`: when this peer's steps of the round began
        self.progress: SwarmProgress | None = None

    @property
    def max_steps(self) -> int:
        return MAX_ROUND_FACTOR * self.inner_steps

    def keep_going(self, step_seconds: float) -> bool:
        """Called by the training thread before each step: whether to take it (see the module).
        The time left is the swarm's expected end, or sooner the steps left of this peer's
        share at its current step time: counted in its own tokens, a peer that speeds up
        mid-round (on a shared host, when the others stop) does not take its faster steps
        past its share."""
        left = min(self.round_end_at - self.clock(), self._share_left_s(step_seconds))
        if left >= step_seconds:
            return True
        if left <= 0:
            return False
        return self.draw() < left / step_seconds

    def _share_left_s(self, step_seconds: float) -> float:
        tokens, per_step = self.own_count()
        if not math.isfinite(self.share_tokens) or per_step <= 0:
            return math.inf
        return (SHARE_SLACK * self.share_tokens - tokens) / per_step * step_seconds

    @staticmethod
    def _share(progress: SwarmProgress | None, below_s: float) -> float:
        """This peer's share of the round's target, in tokens (`SwarmProgress.share`), in a
        round shorter than `below_s`; inf in longer ones, and while a rate is unknown.

        The others' counts reach this peer a heartbeat apart; in a round shorter than that it
        sees them only as they were at the round's start, extrapolated one step at most (see
        peers/pacing.py), and trained on until others closed the round: 13-17% more tokens
        than asked with rounds of half a second (the issue saw 44% at 9d00526). A share needs
        no fresh count, only rates, which change slowly, and every peer divides by the same
        published rates, so the shares add up to the target. The round ends when the share's
        time is up (`SwarmProgress.end_in`): a peer slower than its rate this round trains
        fewer tokens and a faster one more, errors of both signs. A cap in tokens alone would
        make both errors fall short (the slow peer is closed out by the others, the fast one
        stops at its share): measured at 0.85-0.89 of the tokens asked. In tokens, the share
        is a ceiling (x SHARE_SLACK), for a peer that speeds up once the others stop on a
        shared host."""
        if progress is None or math.isinf(share := progress.share):
            return math.inf
        if progress.target / progress.round_rate >= below_s:  # the counts are fresh enough: the swarm's count decides
            return math.inf
        return share

    def time_end(self, records: list[PeerRecord], round_no: int) -> float:
        """When the round's time budget (--round-seconds) ends for this peer, on `clock`: the
        budget after the swarm's median start of the round (peers/pacing.py `swarm_round_began`
        says why), within TIME_BUDGET_RANGE of the budget after its own start; inf without a
        budget. Peers' DHT clocks are their hosts' wall clocks: a host whose clock is off by a
        second ends its steps a second early or late, and the range bounds it like a lie."""
        budget = self.round_seconds
        if not budget:
            return math.inf
        soonest, latest = (self.started_at + share * budget for share in TIME_BUDGET_RANGE)
        began = swarm_round_began(records, round_no, self.dht_time())
        if began is None:
            return self.started_at + budget
        return min(max(self.clock() + began + budget - self.dht_time(), soonest), latest)

    async def update(self, round_no: int) -> None:
        """Read the swarm's progress once and move the expected end."""
        view = await self.view()
        own = self.own()
        self.peers_read = len(view)
        # heartbeats come less often in a large swarm (Membership.beat_s): the limits that are
        # counted in heartbeats stretch with them
        beats = poll_stretch(self.peers_read)
        # others' records extrapolated a heartbeat and a half at most: see peers/pacing.py
        progress = swarm_progress(
            view.values(),
            own,
            round_no,
            self.inner_steps,
            self.round_tokens,
            self.dht_time(),
            max_extrapolation=self.max_extrapolation * beats,
        )
        self.progress = progress
        self.share_tokens = self._share(progress, self.share_below_s * beats)
        self.on_progress(progress)
        shared = math.isfinite(self.share_tokens)  # a short round: the swarm's count, or this peer's share
        self.round_end_at = min(
            self.clock() + (progress.end_in() if shared else progress.seconds_left()),
            self.time_end([r for r in view.values() if r.peer_id != own.peer_id] + [own], round_no),
        )
        near = progress.done >= CLOSE_FRACTION * progress.target and (
            # and near this peer's own share: a fast peer's share is not cut by a slower one's close
            not math.isfinite(self.share_tokens) or progress.own_tokens >= CLOSE_FRACTION * self.share_tokens
        )
        if progress.closed and (near or progress.closed_by_most):
            self.round_end_at = -math.inf  # others closed it: the swarm is averaging, not waiting for this node
        if self.closed_under_us(view, round_no):
            self.round_end_at = -math.inf  # joined in the round's last seconds: see catchup/joiner.py

    def start_round(self) -> float | None:
        """A new round's end is not known yet: called before its first step may ask (else the
        training thread would read the last round's end, already past, and take no step); until
        the first read it is the time budget's from now. Its share is the last read's until this
        round's first read: a round shorter than a DHT read was otherwise trained blind (20 steps
        where 10 were asked). Returns the latest the round's steps may run (on `clock`): the
        budget's end stretched as far as the swarm's start may move it (`time_end`)."""
        self.share_tokens = self._share(self.progress, self.share_below_s * poll_stretch(self.peers_read))
        self.started_at = self.clock()
        budget = self.round_seconds
        self.round_end_at = self.started_at + budget if budget else math.inf
        return self.started_at + TIME_BUDGET_RANGE[1] * budget if budget else None

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
            await asyncio.sleep(self.read_s * poll_stretch(self.peers_read))


Pacer = FixedPacer | SwarmPacer
