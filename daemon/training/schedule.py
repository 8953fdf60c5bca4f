"""The inner learning rate as a function of the swarm's position in training.

The position is the swarm's, not this peer's: `outer_step × H` plus the steps taken in the
current round (counted up to H). Every peer of a round then trains at about the same rate,
whatever its speed; a late joiner that downloads outer step k starts at the swarm's rate
instead of warming up again; and a restarted node resumes its schedule from the outer step
in its checkpoint. Counting a peer's own inner steps instead would give a fast peer a
decayed rate while a new one is still warming up.

Warmup protects a fresh AdamW state (its first updates are ±lr on every coordinate), so it
counts the smaller of the swarm's position and this peer's own inner steps: at the swarm's
start they are equal; a joiner whose optimizer starts fresh warms up again, to the swarm's
decayed rate; a restarted node whose AdamW moments were restored does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SHAPES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class LearningRateSchedule:
    """Linear warmup to `peak`, then cosine or linear decay to `peak × min_ratio` at `total_steps`."""

    peak: float
    warmup_steps: int = 0
    total_steps: int | None = None  # None: the rate stays at its peak after warmup
    shape: str = "cosine"
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"unknown schedule {self.shape!r}; use one of {', '.join(SHAPES)}")

    def __call__(self, step: int, own_steps: int | None = None) -> float:
        """The rate at swarm position `step` for a peer whose AdamW has taken `own_steps` steps."""
        warm = min(step, step if own_steps is None else own_steps)
        warmup = min(1.0, (warm + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        return warmup * self._decayed(step)

    def _decayed(self, step: int) -> float:
        if self.total_steps is None or self.shape == "constant" or step < self.warmup_steps:
            return self.peak
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        if self.shape == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return self.peak * (self.min_ratio + (1.0 - self.min_ratio) * decay)
