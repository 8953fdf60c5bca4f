"""When does the swarm's round end? Progress-paced rounds (hivemind's target batch size).

Every peer publishes, in its membership record, how many tokens it has processed in the
current round, when it counted them, and how fast it goes. Every peer reads all records, so
all of them see the same swarm total within a heartbeat's staleness and reach matchmaking
together. The round ends when that total reaches the round's target: `--round-tokens`, or H
steps of an average peer (H times the sum of the live peers' tokens per step). A fast peer
takes more steps and a slow one fewer; each contributes Δ weighted by the tokens it
processed, so nobody waits for the slowest and nobody is left out.

Records are extrapolated at their published rate, `max_extrapolation` seconds at most past
their count (a heartbeat and a half: a peer that stopped reporting cannot end a round on its
own); a record's `progress_at` is when its count was true, the end of its last inner step (a
slow peer's count is a whole step old half the time), and this peer's own count is
extrapolated the same way. Until a peer has two steps of the round in, its rate is an earlier
round's (with other peers sharing its host, perhaps several times too high): it is extrapolated
one step at most. Counting them as published instead makes every round a heartbeat too long: with rounds
of a few seconds, 20% more tokens than asked. An over-estimate of the others has its own risk:
the peers stop, publish their exact counts, and the last one, seeing the total fall short,
trains the rest alone while the others wait. So a round is also over for a peer as soon as
another peer of the round has closed it (`closed`: it moved on to averaging, or with --overlap
to the next round's steps) once the swarm is near its target, or once half its peers have.

A record is signed by its peer, but what it reports is the peer's own word: one record with a
huge `round_tokens` would end every round at once, a huge `tokens_per_step` stretch rounds to
100 x H. So every report is clamped to `PACING_SPREAD` times the median of the peers' reports
(`clamp_reports`): one peer can move the round's end by a bounded factor, never end or stall it
alone. A rate or batch is bounded by the lower median, a token count by the median of the
others' counts (or, while they have none, one average peer's whole round): in a pair, the
honest peer's report bounds the other's. Within those bounds a claim still counts only as far
as the peer's rate backs it: a step in the round's target (`counted_steps`), a count in the
swarm's progress (`COUNT_SLACK`). Pure functions, no I/O.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from dtnode.ops.robust import lower_median, upper_median


class Progress(Protocol):
    """The fields of a membership record that pacing reads."""

    @property
    def peer_id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def round(self) -> int: ...
    @property
    def phase(self) -> str: ...
    @property
    def round_in_training(self) -> int: ...
    @property
    def round_tokens(self) -> int: ...
    @property
    def tokens_per_step(self) -> int: ...
    @property
    def tokens_per_s(self) -> float: ...
    @property
    def progress_at(self) -> float: ...


ACTIVE = ("training", "averaging")
CLOSED_PHASES = ("matchmaking", "averaging", "outer")  # a record's phase once its round's inner steps ended
MAX_STEP_S = 600.0  # one step is extrapolated this long at most (a record with a tiny rate)
# A report counts at most this many times the peers' median: a peer with an 8x bigger batch or
# an 8x faster device counts in full, a lying one moves the round's end by a bounded factor.
PACING_SPREAD = 8.0
# A count counts at most this many times the others' median count, times the peer's rate over the
# median rate: peers of one rate move through a round together (one that began its round earlier,
# or a stale record, is ahead by less than this), so a count its rate does not back is a claim.
# With a step counted only as far as its rate backs it (`counted_steps`), a record claiming 1e11
# tokens at an honest rate ended four honest peers' rounds of H=50 at 21 steps (8x the median,
# as PACING_SPREAD alone allowed); at 2x they end at 5/6 of H.
COUNT_SLACK = 2.0


@dataclass(frozen=True)
class Report:
    """One peer's progress as pacing counts it: a record's fields, clamped (`clamp_reports`)."""

    peer_id: str
    state: str
    round: int
    phase: str
    round_in_training: int
    round_tokens: int
    tokens_per_step: int
    tokens_per_s: float
    progress_at: float


def _median_without(ordered: Sequence[int], value: int) -> float:
    """The upper median of sorted `ordered` less one occurrence of `value` (if present)."""
    at = bisect.bisect_left(ordered, value)
    present = at < len(ordered) and ordered[at] == value
    size = len(ordered) - present
    if size <= 0:
        return 0.0
    k = size // 2
    return float(ordered[k + 1] if present and at <= k else ordered[k])


def clamp_reports(records: Iterable[Progress], round: int, inner_steps: int = 1) -> list[Report]:
    """The records as pacing counts them: each peer's `tokens_per_step` and `tokens_per_s` at
    most PACING_SPREAD times the lower median of the live peers' (of those that report one).

    A peer's `round_tokens` is bounded by the median count of the round's other peers (those with
    one) times COUNT_SLACK x its rate over the median rate (PACING_SPREAD at most), and never below
    a whole round (`inner_steps`) of a median peer: early
    in a round, beside a slow peer or joiners, most counts are still 0, and a lone liar then
    counts as one peer that finished its round."""
    reports = [
        Report(
            r.peer_id,
            r.state,
            r.round,
            r.phase,
            r.round_in_training,
            max(r.round_tokens, 0),
            max(r.tokens_per_step, 0),
            max(r.tokens_per_s, 0.0) if math.isfinite(r.tokens_per_s) else 0.0,
            r.progress_at,
        )
        for r in records
    ]
    live = [r for r in reports if r.state in ACTIVE]
    if len(live) < 2:
        return reports
    # medians of the peers that report one: a peer that just started has no rate yet
    median_step = lower_median([r.tokens_per_step for r in live if r.tokens_per_step > 0])
    step_cap = PACING_SPREAD * median_step if median_step > 0 else math.inf
    median_rate = lower_median([r.tokens_per_s for r in live if r.tokens_per_s > 0])
    rate_cap = PACING_SPREAD * median_rate if median_rate > 0 else math.inf
    counts = sorted(r.round_tokens for r in live if r.round_in_training == round and r.round_tokens > 0)

    def tokens_cap(own: int, rate: float) -> float:
        # the others' (upper) median count, times what the peer's rate says it may have over them
        # (`COUNT_SLACK` x its rate over the median, PACING_SPREAD at most): a lone liar's claim is
        # no reference for itself, and a count its rate does not back ends no one's round early
        reach = min(PACING_SPREAD, COUNT_SLACK * rate / median_rate) if median_rate > 0 else PACING_SPREAD
        return max(reach * _median_without(counts, own), inner_steps * median_step) or math.inf

    return [
        replace(
            r,
            tokens_per_step=int(min(r.tokens_per_step, step_cap)),
            tokens_per_s=min(r.tokens_per_s, rate_cap),
            round_tokens=int(min(r.round_tokens, tokens_cap(r.round_tokens, min(r.tokens_per_s, rate_cap))))
            if r.round_in_training == round
            else r.round_tokens,
        )
        for r in reports
    ]


@dataclass(frozen=True)
class SwarmProgress:
    target: int  # tokens the swarm processes this round
    done: float  # tokens processed so far, extrapolated to now
    rate: float  # tokens per second of the peers still training
    peers: int  # peers counted
    closed: int = 0  # peers that ended their inner steps of the round (averaging it, or training the next)
    round_peers: int = 0  # peers counted or closed: the round's peers, those past it included
    # inner steps per second of an average peer training the round, and of this one (0: unknown):
    # a peer's pseudo-gradient grows with its steps, not its tokens (a host of 2 ranks takes a
    # step of twice the tokens, in the same time or longer)
    step_rate: float = 0.0
    own_step_rate: float = 0.0
    # this peer's own count (extrapolated like the others') and rate, and the summed rate of
    # every peer of the round, closed ones included: what its share of the target is made of
    own_tokens: float = 0.0
    own_rate: float = 0.0
    round_rate: float = 0.0
    # what a typical peer of the round trained so far: the upper median of the round's counts,
    # closed peers' and this one's included (0: none read). Not the target's share: in a swarm's
    # first round no rate is known, nobody's share either, and peers train on until one closes
    # it (a 4-node swarm's round 0 on 2 cores: 37 and 64 steps of a target of 15 each)
    typical_tokens: float = 0.0

    @property
    def share(self) -> float:
        """This peer's share of the target, in tokens: the part its published rate is of the
        summed published rates of the peers the target counts (inf while a rate is unknown).
        Every peer divides by the same published rates, so the shares add up to the target, and
        each takes the same time, target / summed rate; see daemon/rounds/pacer.py for why a share."""
        if self.own_rate <= 0 or self.round_rate <= 0:
            return math.inf
        return self.target * min(self.own_rate / self.round_rate, 1.0)

    def shortfall(self, trained_tokens: int) -> float:
        """How many times what this peer trained in the round (`trained_tokens`) a typical peer
        of it trained, in tokens or in steps per second, whichever is more (inf after no token):
        the outer step's allowance for a mean of longer Δ than its own (update_bounds.py). A
        typical peer's tokens are the target's share, or the round's counts where peers trained
        more (`typical_tokens`)."""
        typical = max(self.target / max(self.round_peers, self.peers, 1), self.typical_tokens)
        tokens = typical / trained_tokens if trained_tokens > 0 else math.inf
        steps = self.step_rate / self.own_step_rate if self.own_step_rate > 0 else 1.0
        return max(tokens, steps)

    def own_share_seconds_left(self) -> float:
        """Seconds until this peer has trained its `share` at its published rate (inf while a
        rate is unknown)."""
        if math.isinf(share := self.share):
            return math.inf
        return max(share - self.own_tokens, 0.0) / self.own_rate

    def end_in(self) -> float:
        """Seconds until this peer's round ends: when the swarm's count reaches the target, or
        this peer's share of it is trained, whichever comes first."""
        return min(self.seconds_left(), self.own_share_seconds_left())

    @property
    def reached(self) -> bool:
        return self.done >= self.target

    @property
    def closed_by_most(self) -> bool:
        """Whether at least half of the round's peers, those past it included, are past it. A
        peer past it is one of the round's peers too: counted only among the closers, one record
        claiming the next round outvoted two peers training it, and ended every round at once."""
        return self.closed > 0 and 2 * self.closed >= max(self.round_peers, self.peers)

    def seconds_left(self) -> float:
        """Estimated seconds until the target is reached (inf while nobody reports a rate)."""
        if self.reached:
            return 0.0
        return (self.target - self.done) / self.rate if self.rate > 0 else math.inf


def round_target(records: Iterable[Progress], round: int, inner_steps: int, round_tokens: int | None) -> int:
    """The round's token target: absolute, or H steps of every live peer of the round
    (`counted_steps`: a step bigger than the median one counts as far as its rate backs it).

    Peers still finishing the previous round count too: they are about to join this one,
    and a round sized without them would end before they could take part.
    """
    if round_tokens:
        return round_tokens
    live = [r for r in records if r.round_in_training in (round - 1, round) and r.state in ACTIVE]
    return max(inner_steps * sum(counted_steps(live)), 1)


def counted_steps(live: Sequence[Progress]) -> list[int]:
    """Each live peer's step as the round's target counts it: in full up to the median step;
    above it, only the tokens the peer's published rate processes in a median peer's step time
    (and the median step while it has no rate, unless nobody has one yet).

    The target is H steps of every peer, and every peer trains its share of it in the same time
    (its published rate over the summed rates, `SwarmProgress.share`), so one peer's step decides
    how long everybody's round is: a big step at an ordinary rate stretched the rounds of all.
    A record claiming 2^40 tokens a step at an honest rate (clamped to PACING_SPREAD x the median)
    made four honest peers' rounds of H = 50 take 60 to 100 steps, at 0.75x their rounds per
    minute (issue 56's bench). A peer with a bigger batch and a rate to match (a bigger device)
    still counts in full; one with a bigger batch at an ordinary rate (its steps take longer)
    counts what it trains in the time of a median step, so the round lasts H median steps and
    it takes fewer, longer steps in it, as a slow peer does."""
    steps = [max(r.tokens_per_step, 0) for r in live]
    positive = [s for s in steps if s > 0]
    if not positive:
        return steps
    median_step = lower_median(positive)
    times = [r.tokens_per_step / r.tokens_per_s for r in live if r.tokens_per_step > 0 and r.tokens_per_s > 0]
    if not times:  # nobody's rate is known yet (a swarm's first steps): no step time to go by
        return steps
    median_time = lower_median(times)
    counted = []
    for r, step in zip(live, steps, strict=True):
        if step > median_step:
            backed = r.tokens_per_s * median_time if r.tokens_per_s > 0 and math.isfinite(r.tokens_per_s) else 0.0
            step = int(max(median_step, min(step, backed)))
        counted.append(step)
    return counted


def _extrapolation_cap(r: Progress, max_extrapolation: float) -> float:
    """How far past its count a record may be extrapolated: the record's own staleness
    (`max_extrapolation`) plus one of its steps, since the count is as of its last step's end (a
    peer 4x slower is a whole long step behind its count just before the step ends)."""
    if max_extrapolation <= 0:
        return 0.0
    rate = max(r.tokens_per_s, 0.0)
    return max_extrapolation + (min(r.tokens_per_step / rate, MAX_STEP_S) if rate > 0 else 0.0)


def swarm_progress(
    records: Iterable[Progress],
    own: Progress,
    round: int,
    inner_steps: int,
    round_tokens: int | None,
    now: float,
    max_extrapolation: float = 0.0,
) -> SwarmProgress:
    """The swarm's progress in `round` as this peer sees it now (`now` in DHT time).

    `own` is this peer's live progress, which replaces its (older) published record. Every
    report, own included, is clamped first (`clamp_reports`): all peers count the same way.
    """
    records = list(records)
    # the rate others read of this peer (its published record), for its share: every peer then
    # divides the target by the same published rates, and the shares add up to it
    published_rate = next((r.tokens_per_s for r in records if r.peer_id == own.peer_id), own.tokens_per_s)
    records = clamp_reports([r for r in records if r.peer_id != own.peer_id] + [own], round, inner_steps)
    own = records[-1]
    members = {r.peer_id: r for r in records if r.round_in_training == round and r.state in ACTIVE}
    # closed: past this round's inner steps (its record's round and phase), or with --overlap
    # training the next one; not a peer still applying the last round's outer step, whose outer
    # step (and so round_in_training) already names this round
    closers = {
        r.peer_id
        for r in records
        if r is not own
        and r.state in ACTIVE
        and ((r.round == round and r.phase in CLOSED_PHASES) or r.round_in_training == round + 1)
    }
    done, rate, own_tokens = 0.0, 0.0, 0.0
    for r in members.values():
        tokens = float(max(r.round_tokens, 0))
        if r.state == "training":  # own too: its count is as of its last step's end (progress_at)
            elapsed = min(max(now - r.progress_at, 0.0), _extrapolation_cap(r, max_extrapolation))
            extra = max(r.tokens_per_s, 0.0) * elapsed
            if r.round_tokens < 2 * r.tokens_per_step:  # its rate is an earlier round's, not this one's yet
                extra = min(extra, float(max(r.tokens_per_step, 0)))
            tokens += extra
        if r.state == "training":
            rate += max(r.tokens_per_s, 0.0)
        if r is own:
            own_tokens = tokens
        done += tokens
    target = round_target(records, round, inner_steps, round_tokens)
    # the counts of the round's peers (those averaging it included: their count is whole; those
    # training it, as of their last step). The upper median: one peer's claim moves it no further
    # than another peer's count (clamped besides); in a pair it is the larger of the two
    counts = [float(max(r.round_tokens, 0)) for r in members.values()]
    rates = [step_rate(r) for r in members.values() if step_rate(r) > 0]
    share_rate = max(published_rate, 0.0) if math.isfinite(published_rate) else 0.0
    return SwarmProgress(
        target,
        done,
        rate,
        len(members),
        len(closers),
        len(set(members) | closers),
        step_rate=sum(rates) / len(rates) if rates else 0.0,
        own_step_rate=step_rate(own),
        own_tokens=own_tokens,
        own_rate=share_rate if own.peer_id in members else 0.0,
        # a peer silent past its extrapolation (paused, stalled) trains no share: the others take it
        round_rate=sum(
            max(r.tokens_per_s, 0.0)
            for r in members.values()
            if r is not own
            and not (
                r.state == "training"
                and max_extrapolation > 0
                and now - r.progress_at > _extrapolation_cap(r, max_extrapolation)
            )
        )
        + share_rate,
        typical_tokens=upper_median(counts),
    )


def step_rate(r: Progress) -> float:
    """A report's inner steps per second (0 while it reports no rate)."""
    per_step, per_s = max(r.tokens_per_step, 0), max(r.tokens_per_s, 0.0)
    return per_s / per_step if per_step > 0 else 0.0


class RoundStart(Protocol):
    """The fields of a membership record that the time budget of a round reads."""

    @property
    def state(self) -> str: ...
    @property
    def round(self) -> int: ...
    @property
    def round_in_training(self) -> int: ...
    @property
    def round_began_at(self) -> float: ...


def swarm_round_began(records: Iterable[RoundStart], round: int, now: float) -> float | None:
    """When the swarm began `round`'s inner steps, in DHT time: the median of its live peers'
    published starts (`round_began_at`), a peer still in the round before counted as beginning
    `now` (it begins no sooner); None when no peer says. Peers past the round, peers further
    behind and peers that do not say (an older dtnode) are left out.

    With --round-seconds each peer used to count the budget from its own start, and its start is
    when its last average ended, which differs by seconds across a swarm's groups and hops: the
    early peers then waited at the next hop 0 for the late ones, and the late ones set every
    round's pace (on 2 cores, 3-7 s of a 32-node round's hop 0). Ending every peer's steps at the
    median start plus the budget turns the early peers' wait into training and ends the late
    ones' steps with the others. A median: a peer's lie moves it no further than an honest
    peer's start, and the pacer bounds what it may do to one round (`SwarmPacer.time_end`)."""
    starts = []
    for r in records:
        if r.state not in ACTIVE:
            continue
        if r.round == round and r.round_began_at > 0:
            starts.append(min(r.round_began_at, now))
        elif r.round < round and r.round_in_training >= round - 1:
            starts.append(now)
    return statistics.median(starts) if starts else None
