"""Rounds that failed in a row, and how long the node waits before the next try.

A fault that goes away (a peer's broken stream, a one-off error) costs one short pause. A
fault that repeats (a bug met at every inner step, a disk that refuses every write) must
neither spin nor fill the log: after a few quick tries the pause doubles up to a cap, and a
failure like the one before it is logged in one line instead of another traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

FAILED_ROUND_BACKOFF_S = 1.0  # the pause after a failed round, while the streak is short
QUICK_RETRIES = 3  # failures in a row that each wait FAILED_ROUND_BACKOFF_S
MAX_FAILED_ROUND_BACKOFF_S = 30.0  # the longest pause: a fixed fault is found again within it


@dataclass
class FailureStreak:
    count: int = 0
    last: str = ""  # "Type: message" of the last failure

    def failed(self, error: BaseException) -> tuple[float, bool]:
        """One more failed round: the pause before the next, and whether it repeats the last one."""
        signature = f"{type(error).__name__}: {error}"
        repeated = self.count > 0 and signature == self.last
        self.count += 1
        self.last = signature
        doublings = max(0, self.count - QUICK_RETRIES)
        return min(FAILED_ROUND_BACKOFF_S * 2**doublings, MAX_FAILED_ROUND_BACKOFF_S), repeated

    def ended(self) -> None:
        """A round ran to its end: the next failure starts a new streak."""
        self.count, self.last = 0, ""
