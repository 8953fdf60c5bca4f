"""Deadlines that follow what the node has measured, within configured bounds.

Fixed timeouts are what users of decentralized averaging complain about most: too long and
a dead peer stalls everyone, too short and slow links break every group. The matchmaking
window follows how late the last member of recent complete groups arrived; the all-reduce
deadline follows the transfer rate of recent all-reduces, scaled to the size of the next
one. Both start at their upper bound (nothing measured yet) and never leave their bounds.

An all-reduce cut at its deadline counts too, as the rate it fell short of: learning only from
the all-reduces that finished, a deadline learned in a quiet hop 0 cut every busier hop after
it, round after round (24 nodes on 2 cores: every round `partial`, each hop 1 cut at the 3 s
floor while the whole swarm's hop 1 ran at once). A cut now makes the next deadline of that
size at least `margin` x the one that was cut, up to the upper bound, until the history
forgets it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .plan import WireFormat


@dataclass
class AdaptiveDeadlines:
    window_min: float
    window_max: float
    timeout_min: float
    timeout_max: float
    margin: float = 3.0  # multiple of the measured figure a deadline allows
    history: int = 16
    _arrival_lags: deque = field(default_factory=deque)
    _rates: deque = field(default_factory=deque)  # payload bytes per second of recent all-reduces

    def observe_matchmaking(self, last_arrival_lag: float, complete: bool) -> None:
        """Seconds between this node's registration and the arrival of its group's last member.

        Only complete groups say how late members arrive; a group closed by the window says
        only that someone never came.
        """
        if complete and last_arrival_lag >= 0:
            self._push(self._arrival_lags, last_arrival_lag)

    def observe_allreduce(self, payload_bytes: int, seconds: float, ok: bool) -> None:
        if ok and payload_bytes > 0 and seconds > 0:
            self._push(self._rates, payload_bytes / seconds)

    def observe_cut(self, expected_bytes: int, deadline: float) -> None:
        """An all-reduce that was to move `expected_bytes` and was cut at `deadline` seconds with
        parts missing: it moved at most expected_bytes / deadline per second. Only a cut at the
        deadline counts: a member found gone (a refused connection, a lapsed record) ends its
        part early and says nothing about the rate."""
        if expected_bytes > 0 and deadline > 0:
            self._push(self._rates, expected_bytes / deadline)

    def _push(self, queue: deque, value: float) -> None:
        queue.append(value)
        while len(queue) > self.history:
            queue.popleft()

    @property
    def matchmaking_window(self) -> float:
        if not self._arrival_lags:
            return self.window_max
        return _clamp(self.margin * max(self._arrival_lags) + 0.5, self.window_min, self.window_max)

    def later_hop_window(self, previous_hop_bytes: int) -> float:
        """The window of a hop after the first: its peers may still be in the all-reduce of the
        hop before (up to its deadline), so that deadline comes on top of the full window."""
        return self.window_max + self.allreduce_timeout(previous_hop_bytes)

    def allreduce_timeout(self, expected_bytes: int) -> float:
        """Deadline for an all-reduce expected to move `expected_bytes` of payload."""
        if not self._rates:
            return self.timeout_max
        slowest = min(self._rates)
        return _clamp(self.margin * expected_bytes / slowest + 1.0, self.timeout_min, self.timeout_max)

    @property
    def rates_measured(self) -> int:
        return len(self._rates)

    def snapshot(self, expected_bytes: int) -> dict[str, float]:
        return {
            "matchmaking_window_s": round(self.matchmaking_window, 3),
            "allreduce_timeout_s": round(self.allreduce_timeout(expected_bytes), 3),
            "samples": len(self._arrival_lags) + len(self._rates),
        }


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def expected_payload_bytes(numel: int, group_size: int, wire: WireFormat, hop: int = 0) -> int:
    """Payload a member sends plus receives in one butterfly all-reduce of `numel` values in a
    hop (at most: a sparse mean is assumed to hold every member's positions), counted as the
    measured rates count it: its values for the others' parts out and the others' for its part
    in, then the results the other way, each (g-1)/g of the model. (Counting only one way made
    every deadline half of what its margin meant: a 5-node `small` swarm on 2 cores cut its
    third hop's streams at 2.4 s when they took 3.)"""
    if group_size <= 1:
        return 0
    per_value = wire.sent_per_value(hop) + wire.result_per_value(group_size, hop)
    return int(2 * numel * per_value * (group_size - 1) / group_size)
