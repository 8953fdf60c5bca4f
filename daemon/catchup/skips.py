"""Why a fetch of the swarm's checkpoint passed over a donor or a file (`donors.fetch_from_swarm`).

Each pass-over is logged as a warning for the operator, and recorded here as a typed fact for
the caller that asked (`fetch_from_swarm(..., skipped=[])`): a joiner that found no usable
checkpoint, or a test, reads which donors were left out and why without parsing log lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Skip(StrEnum):
    """Why a donor or one of the files it serves was not used."""

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
