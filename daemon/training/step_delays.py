"""The delays tests put into inner steps, applied after each step (read with the failpoints in
peers/failpoints.py, all off unless a test sets them).

`DTNODE_TEST_SLOW_INNER=F` makes every inner step of this process take F times as long, so tests
and benchmarks can build swarms of uneven peers on one host. `DTNODE_TEST_STEP_FLOOR_S=S` makes
every inner step take at least S seconds: a test that times a restart or a join against the
swarm's rounds then sees rounds of about CPU length on a GPU host too, where a tiny model's step
takes a few milliseconds and the swarm would be a dozen rounds on before a restarted process is
back. `DTNODE_TEST_FIRST_STEP_DELAY` holds the process's first step back (a cold start).
"""

from __future__ import annotations

import threading
import time

from dtnode.peers import failpoints

SLOWED_OUTLIER = 4.0  # see StepDelays._unslowed_seconds


class StepDelays:
    def __init__(self) -> None:
        hooks = failpoints.training_hooks()
        self.slowdown = hooks.slowdown
        self.first_step_delay = hooks.first_step_delay_s
        self.step_floor_s = hooks.step_floor_s
        self._unslowed_s = 0.0  # the last step's time before the slowdown stretched it

    def after_step(self, stop: threading.Event, step_started: float, first: bool) -> None:
        """Wait out what the hooks add to the step that began at monotonic `step_started`
        (ended early by `stop`)."""
        if self.slowdown > 1:
            stop.wait((self.slowdown - 1) * self._unslowed_seconds(time.monotonic() - step_started))
        if self.step_floor_s > 0:
            stop.wait(max(0.0, self.step_floor_s - (time.monotonic() - step_started)))
        if first and self.first_step_delay > 0:
            stop.wait(self.first_step_delay)

    def _unslowed_seconds(self, took: float) -> float:
        """What the slowdown stretches: this step's time, but at most SLOWED_OUTLIER times the
        last one's. A step that a SIGSTOP held (a test's pause) is not stretched again: with
        F=10 a 12 s pause became 108 s more, and the paused peer missed the rest of the run."""
        if self._unslowed_s > 0:
            took = min(took, SLOWED_OUTLIER * self._unslowed_s)
        self._unslowed_s = took
        return took
