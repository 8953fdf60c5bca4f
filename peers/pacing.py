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
to the next round's steps) once the swarm is near its target, or once half its peers have. Pure
functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


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


@dataclass(frozen=True)
class SwarmProgress:
    target: int  # tokens the swarm processes this round
    done: float  # tokens processed so far, extrapolated to now
    rate: float  # tokens per second of the peers still training
    peers: int  # peers counted
    closed: int = 0  # peers that ended their inner steps of the round (averaging it, or training the next)

    @property
    def reached(self) -> bool:
        return self.done >= self.target

    def seconds_left(self) -> float:
        """Estimated seconds until the target is reached (inf while nobody reports a rate)."""
        if self.reached:
            return 0.0
        return (self.target - self.done) / self.rate if self.rate > 0 else math.inf


def round_target(records: Iterable[Progress], round: int, inner_steps: int, round_tokens: int | None) -> int:
    """The round's token target: absolute, or H steps of every live peer of the round.

    Peers still finishing the previous round count too: they are about to join this one,
    and a round sized without them would end before they could take part.
    """
    if round_tokens:
        return round_tokens
    per_step = sum(
        max(r.tokens_per_step, 0) for r in records if r.round_in_training in (round - 1, round) and r.state in ACTIVE
    )
    return max(inner_steps * per_step, 1)


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

    `own` is this peer's live progress, which replaces its (older) published record.
    """
    records = [r for r in records if r.peer_id != own.peer_id] + [own]
    members = {r.peer_id: r for r in records if r.round_in_training == round and r.state in ACTIVE}
    # closed: past this round's inner steps (its record's round and phase), or with --overlap
    # training the next one; not a peer still applying the last round's outer step, whose outer
    # step (and so round_in_training) already names this round
    closed = sum(
        1
        for r in records
        if r is not own
        and r.state in ACTIVE
        and ((r.round == round and r.phase in CLOSED_PHASES) or r.round_in_training == round + 1)
    )
    done, rate = 0.0, 0.0
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
        done += tokens
    target = round_target(records, round, inner_steps, round_tokens)
    return SwarmProgress(target, done, rate, len(members), closed)
