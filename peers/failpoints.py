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
results). Two points raise instead of killing: `round-error` (an exception in the round,
after its inner steps), to show that the node's per-round error boundary holds, and
`landing-error` (--overlap: the outer step of round N's average fails as it lands, as when a
local rank dies while θ_l is gathered), to show that the average lands later. One point
pauses: `outer-phase` (`outer-phase@2:6` holds the node 6 s right after it applied round 2's
outer step, without blocking its event loop), so a test can land a joiner in that phase.
One point makes the node lie from that round on: `wrong-checkpoint` (`wrong-checkpoint@1`
writes every checkpoint of step 1 and later with θ_g shifted, hashed and announced as if
right, while the node itself trains on), so a test can show joiners skip a lying donor.
One point makes θ_g differ silently: `diverge-theta` (`diverge-theta@1` moves one value of
θ_g by one ulp right after round 1's outer step, and the node announces its new hash as if
nothing happened), as a result that came out in other bits would, so a test can see the
next groups find the two hashes and re-sync. One point freezes the training thread:
`stall-training@1:30` holds it 30 s after round 1's first inner step, as a hung GPU would,
so a test can see `/healthz` turn 503.

Hostile points turn the node into an attacker from that round on, for the security tests and
the hostile-peer benchmark (`tests.bench.hostile`); each runs the project's own code with
one input changed, as a hostile build would:
- `hostile-delta`: sends Δ x HOSTILE_SCALE at its honest weight;
- `hostile-weight`: the same Δ, announcing HOSTILE_TOKENS in its registration and claiming
  MAX_WEIGHT in its streams;
- `hostile-resync`: asks every group for a θ_g re-sync and sends θ_g x HOSTILE_SCALE there,
  claiming MAX_WEIGHT;
- `hostile-bandwidth`: the scaled Δ, advertising HOSTILE_BANDWIDTH to reduce most of Δ;
- `hostile-pacing`: its record claims HOSTILE_TOKENS tokens in the round and 2^40 per step;
- `hostile-leader`: registers as if first (and closing an hour on), then never closes a group;
- `hostile-pair`: closes a list naming itself and one other registrant the moment it reads one,
  asks that pair for a θ_g re-sync and sends 2T - θ there (T = PAIR_TARGET x θ: the pair's mean);
- `hostile-zero-weight`: announces a weight of 0 and sends Δ x HOSTILE_SCALE claiming MAX_WEIGHT;
- `hostile-shadow`: stores plain values, expiring in years, under the swarm's membership key and
  the group keys of the coming rounds, as an outsider with a plain hivemind DHT could;
- `hostile-donors`: serves θ_g + 1 (as `wrong-checkpoint`) and files Sybil records, signed by
  keys of their own, that announce that file at other names of its sidecar's host;
- `hostile-pinning`: asks every peer's sidecar for its newest checkpoint and a byte of every
  step it serves, several times a second (each ask used to pin its step);
- `hostile-slots`: keeps HOSTILE_STREAMS averaging streams open to every peer, sending nothing.

One point kills a member where its death cost the most: `grouped` (`grouped@3`: this member's
hop-0 group of round 3 formed, and it dies before its first stream leaves).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

ENV = "DTNODE_TEST_FAILPOINT"
HOSTILE = (
    "hostile-delta",
    "hostile-weight",
    "hostile-resync",
    "hostile-bandwidth",
    "hostile-pacing",
    "hostile-leader",
    "hostile-pair",
    "hostile-zero-weight",
    "hostile-shadow",
    "hostile-donors",
    "hostile-pinning",
    "hostile-slots",
)
POINTS = (
    "sending",
    "grouped",
    "reducing",
    "round-error",
    "landing-error",
    "outer-phase",
    "wrong-checkpoint",
    "stall-training",
    "diverge-theta",
    *HOSTILE,
)
HOSTILE_SCALE = 1000.0  # how far a hostile Δ or θ_g is from an honest one
HOSTILE_TOKENS = 1e11  # a hostile token count (a registration may carry up to 1e12)
HOSTILE_BANDWIDTH = 1e9  # Mbit/s, the largest a registration may carry
HOSTILE_CLAIM = 1e12  # a hostile stream's weight: MAX_WEIGHT
PAIR_TARGET = -2.5  # hostile-pair: where it moves a pair's θ_g, x θ (‖T - θ‖ = 3.5‖θ‖)
HOSTILE_STREAMS = 24  # hostile-slots: streams held open to each peer
RAISING = ("round-error", "landing-error")
PAUSING = ("outer-phase", "stall-training")
DEFAULT_PAUSE_S = 5.0


def _parse(spec: str | None) -> tuple[str, int] | None:
    global _pause_s
    if not spec:
        return None
    name, _, round_ = spec.partition("@")
    round_, _, seconds = round_.partition(":")
    if name not in POINTS or not round_.isdigit() or (seconds and (name not in PAUSING or not seconds.isdigit())):
        raise ValueError(
            f"{ENV}={spec!r}: expected one of {', '.join(POINTS)} then @round (and :seconds for "
            f"{', '.join(PAUSING)}), e.g. reducing@2 or outer-phase@2:6"
        )
    _pause_s = float(seconds) if seconds else DEFAULT_PAUSE_S
    return name, int(round_)


@dataclass(frozen=True)
class TrainingHooks:
    """The trainer's test hooks, from DTNODE_TEST_SLOW_INNER (every inner step takes this many
    times as long: uneven peers on one host), DTNODE_TEST_FIRST_STEP_DELAY (seconds added to the
    process's first step: a cold start) and DTNODE_TEST_STEP_FLOOR_S (the least time of a step:
    CPU-length rounds on a GPU host)."""

    slowdown: float = 1.0
    first_step_delay_s: float = 0.0
    step_floor_s: float = 0.0


def training_hooks() -> TrainingHooks:
    return TrainingHooks(
        slowdown=_hook_number("DTNODE_TEST_SLOW_INNER", 1.0),
        first_step_delay_s=_hook_number("DTNODE_TEST_FIRST_STEP_DELAY", 0.0),
        step_floor_s=_hook_number("DTNODE_TEST_STEP_FLOOR_S", 0.0),
    )


def _hook_number(name: str, least: float) -> float:
    """A test hook's number from the environment (unset or empty: `least`, which does nothing);
    a value that is not a finite number >= `least` is refused by the variable's name."""
    raw = os.environ.get(name, "")
    if not raw:
        return least
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not (math.isfinite(value) and value >= least):
        raise ValueError(f"{name}={raw!r} must be a number >= {least:g}")
    return value


class FailpointError(RuntimeError):
    """Raised by a raising failpoint: an injected fault, not a bug."""


_pause_s = DEFAULT_PAUSE_S
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


def hostile(round_: int) -> str | None:
    """The hostile point armed for this round or an earlier one, if any (see the module)."""
    return _armed[0] if _armed is not None and _armed[0] in HOSTILE and round_ >= _armed[1] else None


def armed() -> str | None:
    """The name of the armed point, whatever its round (a hostile node starts its attacks at once)."""
    return _armed[0] if _armed is not None else None


def active_since(name: str, round_: int) -> bool:
    """Whether the standing point `name` is armed for this round or an earlier one."""
    return _armed is not None and _armed[0] == name and round_ >= _armed[1]


def serves_wrong_checkpoint(step: int) -> bool:
    """Whether this node's checkpoint files of `step` lie (`wrong-checkpoint`, `hostile-donors`)."""
    return active_since("wrong-checkpoint", step) or hostile(step) == "hostile-donors"


def take(name: str, round_: int) -> bool:
    """Whether the point `name` is armed for this round; once (it is disarmed)."""
    global _armed
    if _armed is not None and _armed == (name, round_):
        _armed = None
        print(f"failpoint {name}@{round_} reached", file=sys.stderr, flush=True)
        return True
    return False


def hold(name: str, round_: int) -> None:
    """Block the calling thread (the training thread: a frozen GPU, a deadlock) if the pausing
    point `name` is armed for this round; once."""
    global _armed
    if _armed is not None and _armed == (name, round_):
        _armed = None
        print(f"failpoint {name}@{round_} reached: holding this thread {_pause_s:.0f}s", file=sys.stderr, flush=True)
        time.sleep(_pause_s)


async def pause(name: str, round_: int) -> None:
    """Hold the caller (not the event loop) here if the pausing point `name` is armed for this round."""
    if _armed is not None and _armed == (name, round_):
        print(f"failpoint {name}@{round_} reached: pausing {_pause_s:.0f}s", file=sys.stderr, flush=True)
        await asyncio.sleep(_pause_s)
