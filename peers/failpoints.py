"""Failpoints: named places in the data plane where a chaos test can make this process die.

A signal sent from outside on a polled `/status` phase cannot land reliably inside an
all-reduce that lasts 50 ms, let alone between a sender's first and last chunk; a failpoint
can. It is armed only by the `DTNODE_TEST_FAILPOINT` environment variable (`name@round`,
e.g. `reducing@2`), never by the settings model, since it is a test hook rather than an
option; unarmed it costs one comparison. When the named point is reached in that round, the
process says so on stderr (so the harness can show the fault fired where it was meant to)
and SIGKILLs itself: no cleanup runs, exactly as after kill -9 from outside.

Points: `sending` (this member handed a remote reducer at least one chunk and is about to
send another), `reducing` (this member's reducer folded a remote sender's chunk and owes
results). One point raises instead of killing: `round-error` (an exception in the round,
after its inner steps), to show that the node's per-round error boundary holds.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "DTNODE_TEST_FAILPOINT"
POINTS = ("sending", "reducing", "round-error")
RAISING = ("round-error",)


def _parse(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, round_ = spec.partition("@")
    if name not in POINTS or not round_.isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected one of {', '.join(POINTS)} then @round, e.g. reducing@2")
    return name, int(round_)


class FailpointError(RuntimeError):
    """Raised by a raising failpoint: an injected fault, not a bug."""


_armed = _parse(os.environ.get(ENV))


def reach(name: str, round_: int) -> None:
    """Die here (or raise, for a raising point) if the failpoint `name` is armed for this round."""
    global _armed
    if _armed is not None and _armed == (name, round_):
        if name in RAISING:  # once: the retried round must go through
            _armed = None
            raise FailpointError(f"failpoint {name}@{round_} reached")
        print(f"failpoint {name}@{round_} reached: killing this process", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
