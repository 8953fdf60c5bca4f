"""Where a node's θ_g came from when it was not the node's own outer step.

A node's θ_g is normally the result of its own outer step on its group's average. Three other
ways put one in place: the node resumed from a checkpoint of its own at start, it downloaded a
peer's checkpoint (a join, a catch-up, a rollback to the swarm's branch), or, entering a round
without its part in the previous average, it took the swarm's θ_g at that round's end
(`--overlap`). The checkpoint store sees all three, so it notes each here; the round recorder
takes what was noted into the next round's history entry (`synced`). An operator reading
`/history` then sees which rounds began from someone else's θ_g (and, for a joiner whose first
round closed under it, which round and how many steps that download dropped), and a test reads
the same facts from state instead of from a log sentence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum, StrEnum
from typing import Any


class ThetaSource(str, Enum):
    RESUMED = "resumed"  # this node's own checkpoint, read at start
    DOWNLOADED = "downloaded"  # a peer's checkpoint, installed whole
    TAKEN = "taken"  # the swarm's θ_g of a round's end, taken instead of an outer step of its own


# what a history entry keeps of a download's pass-overs: this many, each naming this many donors
# and this many characters of its detail
PASSED_OVER_LIMIT = 16
DETAIL_CHARS = 240


class Skip(StrEnum):
    """Why a download passed over a donor or one of the files it serves (catchup/donors.py
    `fetch_from_swarm`): each pass-over is also a warning naming the donors, and a count in
    `dtnode_checkpoint_skips_total{why}`."""

    # its probe gave nothing usable: unreachable, refused (401), a size past the model's bound
    NO_OFFER = "no_offer"
    # no signed record announces the file it serves
    UNANNOUNCED = "unannounced"
    # (a running node) not a majority of the hosts it can verify serve that step
    NO_MAJORITY = "no_majority"
    # more network groups serve another file of the step
    CONTRADICTED = "contradicted"
    # the records are not all in: more hosts serve, or write, another file of the step than announce this one
    NOT_YET = "not_yet"
    # the download, or the checks of the file it gave, failed
    FAILED = "failed"
    # the caller's judge refused a file no majority serves (catchup/trust_radius.py)
    REFUSED = "refused"


@dataclass(frozen=True)
class Skipped:
    """One pass-over: why, which donors (their peer ids), the step (None: no offer to name one),
    and what was wrong in words (an error's message, the judge's reason)."""

    why: Skip
    peers: tuple[str, ...]
    step: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class Download:
    """How a checkpoint file came from the swarm: what the download that assembled it
    (catchup/download.py) tells the checkpoint read from it, and its arrival the history."""

    offered_by: int  # the donors asked for the file: each announced its sha256
    served_by: int  # those whose ranges made it (a file of one range comes from one donor)
    size_bytes: int
    passed_over: tuple[Skipped, ...] = ()  # donors and files the fetch that found it left out, and why
    resumes: int = 0  # ranges asked again from the byte where a donor had dropped the connection


@dataclass(frozen=True)
class DroppedRound:
    """A joiner's first round, closed by its peers while it took its first steps in it: the
    download that followed replaced it (catchup/joiner.py `enter_next_round`), and its steps are
    a Δ nobody could average any more."""

    round_no: int
    steps: int


@dataclass(frozen=True)
class ThetaArrival:
    source: ThetaSource
    step: int  # the outer step of the θ_g that arrived
    download: Download | None = None  # a peer's file: from how many donors, and its size
    params_sha256: str | None = None  # a resume: the hash of the θ_g read from the file
    dropped: DroppedRound | None = None  # a joiner's re-entry: the round it gave up for this θ_g

    def entry(self) -> dict[str, Any]:
        """Its line in a history entry's `synced`; a download also says from how many peers and
        how many bytes, a resume the hash of what it read (a test reads them here, not from the
        log)."""
        entry: dict[str, Any] = {"source": self.source.value, "step": self.step}
        if self.params_sha256 is not None:
            entry["params_sha256"] = self.params_sha256
        if self.download is not None:
            d = self.download
            entry |= {
                "offered_by": d.offered_by,
                "served_by": d.served_by,
                "bytes": d.size_bytes,
                "resumes": d.resumes,
            }
            entry["passed_over"] = passed_over_entries(d.passed_over)
        if self.dropped is not None:
            entry |= {"dropped_round": self.dropped.round_no, "dropped_steps": self.dropped.steps}
        return entry


def passed_over_entries(passed_over: tuple[Skipped, ...]) -> list[dict[str, Any]]:
    """The donors a fetch passed over as `/history` and `/status` show them: bounded, since the
    details quote what donors sent and Sybil records can name many donors."""
    return [
        {
            "why": p.why.value,
            "peers": list(p.peers[:PASSED_OVER_LIMIT]),
            "step": p.step,
            "detail": p.detail[:DETAIL_CHARS],
        }
        for p in passed_over[:PASSED_OVER_LIMIT]
    ]


@dataclass(frozen=True)
class FetchMiss:
    """A fetch of the swarm's state that installed nothing: the steps it asked for, when (wall
    time), and every donor or file it passed over, and why. `/status` shows the last one until a
    θ_g arrives, so an operator whose node keeps catching up reads why there (a split vote, donors
    whose files fail their checks, records not all in yet) without the log."""

    first_step: int
    last_step: int
    at: float
    passed_over: tuple[Skipped, ...]


class Arrivals:
    """The arrivals since the last recorded round, oldest first (a few at most: the list is
    bounded so that a node that syncs without ever finishing a round holds no more than that)."""

    LIMIT = 16

    def __init__(self) -> None:
        self._pending: list[ThetaArrival] = []
        self.noted = 0  # arrivals noted since start: a caller tells whether one came during its call
        self.last_miss: FetchMiss | None = None  # the last fetch that installed nothing, since the last arrival

    def note(self, arrival: ThetaArrival) -> None:
        self._pending = [*self._pending, arrival][-self.LIMIT :]
        self.noted += 1
        self.last_miss = None

    def missed(self, miss: FetchMiss) -> None:
        """A fetch found nothing to install (see FetchMiss)."""
        self.last_miss = miss

    def replacing(self, dropped: DroppedRound, noted_before: int) -> None:
        """The arrival noted since `noted` read `noted_before` replaced the round `dropped`; a
        call that noted none (nothing was installed) marks nothing."""
        if self.noted > noted_before and self._pending:
            self._pending[-1] = replace(self._pending[-1], dropped=dropped)

    def take(self) -> tuple[ThetaArrival, ...]:
        """What arrived since the last call, for the round being recorded."""
        taken, self._pending = tuple(self._pending), []
        return taken
