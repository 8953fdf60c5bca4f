"""What a round and the node report, as typed records built once.

`RoundSummary` is the whole account of one round: `/status.last_round`, the `/history`
entry, the metrics and the round's log line are all made from it, so they cannot disagree
(the byte sums, the outcome and the phase times are each computed in one place).
`RunStats` keeps what spans rounds (throughput, utilization, recent outcomes), and
`NodeStatus` is the `/status` document.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict
from rich.filesize import decimal as human_bytes

from dtnode.daemon.checkpoints.arrivals import ThetaArrival
from dtnode.daemon.records.history import finite_or_none
from dtnode.daemon.records.state import NodeState
from dtnode.daemon.telemetry.metrics import NodeMetrics, failure_reason
from dtnode.daemon.training.trainer import InnerResult
from dtnode.peers.averager import AveragingResult, HopReport
from dtnode.peers.pacing import SwarmProgress

RECENT_ROUNDS = 5  # the outcomes the condition banner judges by


class RoundOutcome(StrEnum):
    """How a round ended (the `dtnode_rounds_total` label): full (every group whole, no part
    failed), partial (a group lacked a member or a part failed), alone (no group), failed (raised)."""

    FULL = "full"
    PARTIAL = "partial"
    ALONE = "alone"
    FAILED = "failed"


class Condition(StrEnum):
    """One word for the dashboard's banner and `dtnode status`."""

    CATCHING_UP = "catching up"
    FAILING = "failing"
    ALONE = "alone"
    STARTING = "starting"
    OK = "ok"


class LastRound(BaseModel):
    """`/status.last_round`: the last round as this node saw it (its first hop's group)."""

    model_config = ConfigDict(frozen=True)

    outer_step: int
    group_size: int
    group_key: str
    included_peers: list[str]
    matchmaking_s: float
    duration_s: float
    allreduce_s: float
    bytes_sent: int
    bytes_received: int
    failed_parts: list[str]
    weight_after: float
    full: bool
    hops: list[dict[str, Any]]
    inner_steps: int
    tokens: int
    inner_s: float
    loss: float | None
    eval_loss: float | None
    inner_lr: float
    landed_after_steps: int | None
    compression: str = "int8"
    bytes_per_param: float = 0.0  # this node's bytes sent in the round, per parameter of Δ
    density: float = 1.0  # share of Δ's values a sender puts on the wire (sparse: top_k / block)
    feedback_norm: float | None = None  # L2 norm of what this node has not sent yet


@dataclass(frozen=True)
class WireStats:
    """How the round's Δ travelled: what `/status`, `/metrics` and the round line show."""

    compression: str
    numel: int
    density: float
    feedback_norm: float | None


@dataclass(frozen=True)
class RoundSummary:
    """One round, after its outer step (with --overlap: the previous round's average, whose
    outer step landed after `landed_after_steps` of this round's inner steps)."""

    round_no: int
    outer_step: int  # θ_g's step once the round is done
    inner: InnerResult
    result: AveragingResult | None
    duration_s: float
    waited_s: float  # --overlap: this round's wait for the previous average
    eval_s: float
    overlap: bool
    eval_loss: float | None
    eval_step: int | None
    inner_lr: float
    landed_after_steps: int | None
    peer_id: str
    wire: WireStats | None = None
    # what this node scaled down to its bound of its own recent Δ in the round's outer step:
    # "mean" (the averaged Δ), "momentum" (update_bounds.py)
    bounded: tuple[str, ...] = ()
    # θ_g's that came from elsewhere than this node's outer step since its last recorded round
    # (a resume, a download, the swarm's θ_g taken at a round's end: checkpoints/arrivals.py)
    synced: tuple[ThetaArrival, ...] = ()

    @property
    def bytes_per_param(self) -> float:
        return self.bytes_sent / self.wire.numel if self.wire is not None and self.wire.numel else 0.0

    @property
    def hops(self) -> list[HopReport]:
        return self.result.hops if self.result is not None else []

    @cached_property
    def bytes_sent(self) -> int:
        return sum(h.bytes_sent for h in self.hops)

    @cached_property
    def bytes_received(self) -> int:
        return sum(h.bytes_received for h in self.hops)

    @cached_property
    def phases(self) -> dict[str, float]:
        """Seconds of each phase; overlapped, the average runs during inner steps and only the
        wait for it blocks the round."""
        matchmaking = sum(h.matchmaking_s for h in self.hops)
        allreduce = sum(h.allreduce_s + (h.theta_resync_s or 0.0) for h in self.hops)
        averaging = self.waited_s if self.overlap else matchmaking + allreduce
        return {
            "inner": self.inner.seconds,
            "matchmaking": matchmaking,
            "allreduce": allreduce,
            "waiting": averaging if self.overlap else 0.0,
            "eval": self.eval_s,
            "outer": max(0.0, self.duration_s - self.inner.seconds - averaging - self.eval_s),
        }

    @cached_property
    def outcome(self) -> RoundOutcome:
        if self.result is None or self.result.alone:
            return RoundOutcome.ALONE
        return RoundOutcome.FULL if self.result.clean else RoundOutcome.PARTIAL

    @cached_property
    def reasons(self) -> list[str]:
        """Why hops fell short: each failed part's code, groups that lacked a member, and groups
        whose mean lacked one in some part."""
        found = [failure_reason(code) for h in self.hops for code in h.failure_codes]
        return (
            found
            + ["incomplete_group" for h in self.hops if not h.complete and h.group_size > 1]
            + ["dropped_sender" for h in self.hops if h.dropped_senders]
        )

    @property
    def groups(self) -> str:
        """`3/3 2/3+1`: each hop's group size over the size expected (+ extra groups joined)."""
        return (
            " ".join(
                f"{h.group_size}/{h.expected}" + (f"+{h.extra_groups}" if h.extra_groups else "") for h in self.hops
            )
            or "-"
        )

    def last_round(self) -> LastRound:
        first = self.hops[0] if self.hops else HopReport(0, "", 1, 1, 0, True, [self.peer_id], 0.0, 0.0)
        return LastRound(
            outer_step=self.round_no,
            group_size=first.group_size,
            group_key=first.group_key,
            included_peers=first.included_peers,
            matchmaking_s=round(sum(h.matchmaking_s for h in self.hops), 4),
            duration_s=round(self.duration_s, 4),
            allreduce_s=round(sum(h.allreduce_s for h in self.hops), 4),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            failed_parts=[p for h in self.hops for p in h.failed_parts],
            weight_after=self.result.weight if self.result is not None else 0.0,
            full=all(h.complete for h in self.hops),
            hops=[h.as_dict() for h in self.hops],
            inner_steps=self.inner.steps,
            tokens=self.inner.tokens,
            inner_s=round(self.inner.seconds, 4),
            loss=finite_or_none(self.inner.mean_loss),
            eval_loss=self.eval_loss,
            inner_lr=self.inner_lr,
            landed_after_steps=self.landed_after_steps,
            **(
                {
                    "compression": self.wire.compression,
                    "bytes_per_param": round(self.bytes_per_param, 5),
                    "density": self.wire.density,
                    "feedback_norm": self.wire.feedback_norm,
                }
                if self.wire is not None
                else {}
            ),
        )

    def history_entry(self, tokens_total: int, tokens_per_s: float) -> dict[str, Any]:
        """The round's line in `/history` and history.jsonl."""
        return {
            "step": self.outer_step,
            "round": self.round_no,
            "time": round(time.time(), 3),
            "loss": self.inner.mean_loss,
            "tokens": self.inner.tokens,
            "eval_loss": self.eval_loss if self.eval_step == self.outer_step else None,
            "tokens_total": tokens_total,
            "tokens_per_s": round(tokens_per_s, 1),
            "inner_steps": self.inner.steps,
            "lr": self.inner_lr,
            "groups": [[h.group_size, h.expected] for h in self.hops],
            "benched": sorted({p for h in self.hops for p in h.benched}),
            # hop 0's cell peers its group closed without, found to have formed their own group of
            # the cell's key (its share went on beside): why a round with a short hop 0 is full
            "formed_beside": sorted({p for h in self.hops for p in h.formed_beside}),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "phases_s": {k: round(v, 3) for k, v in self.phases.items()},
            # of the matchmaking phase, the seconds spent until each hop's last registrant was read
            "matchmaking_waited_s": round(sum(h.waited_s for h in self.hops), 3),
            "duration_s": round(self.duration_s, 3),
            "outcome": self.outcome.value,
            "reasons": sorted(set(self.reasons)),
            "landed_after_steps": self.landed_after_steps,
            "bounded": list(self.bounded),
            "synced": [arrival.entry() for arrival in self.synced],
        }

    def log_line(self, tokens_per_s: float, loss_floor: float | None) -> str:
        """The round's log line, up to the params hash (appended once it is computed)."""
        loss = "-" if math.isnan(self.inner.mean_loss) else f"{self.inner.mean_loss:.4f}"
        held_out = "-" if self.eval_loss is None else f"{self.eval_loss:.4f}"
        if self.eval_loss is not None and self.eval_step != self.outer_step:
            held_out += f"@{self.eval_step}"  # --eval-every: the last eval, of an earlier θ_g
        floor = f" (floor {loss_floor:.3f})" if loss_floor else ""
        allreduce = round(sum(h.allreduce_s for h in self.hops), 4)
        return (
            f"round {self.round_no} | groups {self.groups} | {self.inner.steps} steps {self.inner.tokens} tok | "
            f"lr {self.inner_lr:.3g} | loss {loss} | eval {held_out}{floor} | allreduce {allreduce:.3f}s "
            f"({human_bytes(self.bytes_sent)} sent) | {self._wire_text()}{tokens_per_s:.0f} tok/s | params "
        )

    def _wire_text(self) -> str:
        w = self.wire
        if w is None:
            return ""
        text = f"{w.compression} {self.bytes_per_param:.3g} B/param"
        if w.density < 1:
            text += f", {w.density:.2%} kept"
        if w.feedback_norm is not None:
            text += f", feedback {w.feedback_norm:.3g}"
        return text + " | "

    def observe(self, m: NodeMetrics) -> None:
        """The round into the metrics (the gauges that span rounds are set by the caller)."""
        m.rounds.labels(outcome=self.outcome.value).inc()
        for reason in self.reasons:
            m.hop_failures.labels(reason=reason).inc()
        for code in (code for h in self.hops for code in h.retried_codes):
            m.stream_retries.labels(reason=failure_reason(code)).inc()
        m.loss.set(self.inner.mean_loss)
        m.eval_loss.set(self.eval_loss if self.eval_loss is not None else math.nan)
        m.tokens.inc(self.inner.tokens)
        m.group_size.set(self.hops[0].group_size if self.hops else 1)
        if self.wire is not None:
            m.wire_bytes_per_param.labels(compression=self.wire.compression).set(self.bytes_per_param)
            m.wire_density.set(self.wire.density)
        m.round_seconds.observe(self.duration_s)
        m.last_round_at.set(time.time())
        for phase, seconds in self.phases.items():
            m.phase_seconds.labels(phase=phase).observe(seconds)
        for h in self.hops:
            if h.theta_resync_s is not None:
                m.theta_resyncs.labels(reason="diverged" if h.unasked_resync else "asked").inc()
            m.allreduce_sent.inc(h.bytes_sent)
            m.allreduce_received.inc(h.bytes_received)
            if h.allreduce_s:
                m.allreduce_seconds.observe(h.allreduce_s)


class RunStats:
    """What spans rounds: throughput, the share of time in inner steps, recent outcomes."""

    def __init__(self) -> None:
        self.inner_seconds = 0.0  # wall time in inner steps since the first round began
        self.first_round_at: float | None = None  # monotonic
        self.last_round_end_at: float | None = None  # monotonic
        self.tokens_per_s = 0.0  # of the last round
        self.rate_estimate = 0.0  # what the record announces before this round's own rate is known
        self.round_failures = 0
        self.recent: collections.deque[RoundOutcome] = collections.deque(maxlen=RECENT_ROUNDS)
        self.last: RoundSummary | None = None  # the last round that ended (its outer step made)
        self.round_progress: SwarmProgress | None = None  # the swarm's progress in this round (swarm pacing)

    def show_progress(self, progress: SwarmProgress) -> None:
        self.round_progress = progress

    def round_started(self) -> None:
        if self.first_round_at is None:
            self.first_round_at = time.monotonic()

    def observe_inner(self, inner: InnerResult) -> None:
        self.inner_seconds += inner.seconds
        if inner.seconds > 0 and inner.tokens:
            self.tokens_per_s = inner.tokens / inner.seconds
            # the smaller of the last round and a running mean: one round with the machine to itself is no rule
            self.rate_estimate = (
                min(self.tokens_per_s, 0.5 * (self.rate_estimate + self.tokens_per_s))
                if self.rate_estimate
                else self.tokens_per_s
            )

    def round_ended(self, outcome: RoundOutcome) -> None:
        self.recent.append(outcome)
        if outcome == RoundOutcome.FAILED:
            self.round_failures += 1
        else:
            self.last_round_end_at = time.monotonic()

    def live_rate(self, round_tokens: int, tokens_per_step: int, round_seconds: float) -> float:
        """Tokens per second this round so far, once two steps are in; before that a cautious
        estimate from earlier rounds. Every peer predicts the round's end from the swarm's
        summed rate: an over-estimate would have them all expect it too soon."""
        if round_tokens >= 2 * tokens_per_step and round_seconds > 0:
            return round_tokens / round_seconds
        return self.rate_estimate

    def utilization(self, until: float | None = None) -> float | None:
        """The fraction of wall time since the first round began (up to `until`, monotonic;
        default now) spent in inner steps."""
        if self.first_round_at is None:
            return None
        end = time.monotonic() if until is None else until
        return min(1.0, self.inner_seconds / max(end - self.first_round_at, 1e-9))

    def condition(self, state: NodeState) -> tuple[Condition, str]:
        """The banner's word and a line saying why."""
        recent = list(self.recent)
        bad = sum(o in (RoundOutcome.FAILED, RoundOutcome.PARTIAL) for o in recent)
        if state in (NodeState.JOINING, NodeState.SYNCING):
            return Condition.CATCHING_UP, "downloading the swarm's state"
        if recent and (recent[-1] == RoundOutcome.FAILED or bad >= 3):
            return (
                Condition.FAILING,
                f"{bad} of the last {len(recent)} rounds failed or were partial; see the node's log",
            )
        if recent and recent[-1] == RoundOutcome.ALONE:
            return Condition.ALONE, "no other peer averaged with this node last round"
        if not recent:
            return Condition.STARTING, "no round finished yet"
        return Condition.OK, f"last round {recent[-1].value}"
