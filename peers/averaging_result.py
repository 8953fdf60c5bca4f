"""What one outer step's averaging produced: a typed report per hop, and the result.

Reports are what `/status`, `/history`, the metrics and the round's log line are built
from (daemon/records/report.py); the result is what the outer step applies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from dtnode.ops.coded import CodedDelta

from .part_result import DriftBound


@dataclass
class HopReport:
    """What one hop did, as this node saw it (its primary group; extra groups summed)."""

    hop: int
    group_key: str
    group_size: int
    expected: int
    registrants: int
    complete: bool
    included_peers: list[str]
    matchmaking_s: float
    window_s: float
    # of matchmaking_s, the seconds until this node read its group's last registrant: waiting for
    # a member still on its way (its previous hop, a slower step), not the forming's own cost
    waited_s: float = 0.0
    allreduce_s: float = 0.0
    timeout_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    failed_parts: list[str] = field(default_factory=list)
    failure_codes: list[str] = field(default_factory=list)  # per failed part: its gRPC code or error type
    retried_codes: list[str] = field(default_factory=list)  # per stream that broke and was sent again: its code
    extra_groups: int = 0
    theta_resync_s: float | None = None
    unasked_resync: bool = False  # θ_g re-synced because members' hashes differed, not on request
    benched: list[str] = field(default_factory=list)  # registrants this node left out: they let its groups down
    # peers of hop 0's cell its list closed without, found after the hops in groups of the cell's
    # own: the hop counts whole (`MoshpitAverager.hop0_whole_beside`)
    formed_beside: list[str] = field(default_factory=list)
    # a typical member's announced weight over this node's (`plan.weight_shortfall`)
    weight_shortfall: float = 1.0

    @property
    def dropped_senders(self) -> int:
        """Members of the group missing from a part that succeeded: a reducer dropped them at its
        deadline (or their stream failed), so the group's mean lacks their values there. They
        take that mean all the same (`reducer.SenderLate`), and θ_g stays one, but the round
        lost their share of the part (this node's own, where it is the one missing)."""
        if self.group_size <= 1 or not self.included_peers:
            return 0
        return max(0, self.group_size - len(self.included_peers))

    @property
    def clean(self) -> bool:
        return self.complete and not self.failed_parts and not self.dropped_senders

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class AveragingResult:
    mean: torch.Tensor | CodedDelta  # the buffer holding the averaged Δ (coded, if Δ was)
    weight: float  # the tokens the mean stands for
    hops: list[HopReport]
    theta: torch.Tensor | None  # averaged θ_g (and momentum, if any), when a re-sync happened
    theta_bound: DriftBound | None = None  # how far `theta` may move this node's state, as a whole

    @property
    def clean(self) -> bool:
        return all(h.clean for h in self.hops)

    @property
    def group_shortfall(self) -> float:
        """How many times this node's tokens its hop-0 group's typical member trained (1.0 with
        no hop): what the mean's Δ may be longer than its own by (update_bounds.py)."""
        return self.hops[0].weight_shortfall if self.hops else 1.0

    @property
    def alone(self) -> bool:
        """No hop found a partner (no hops at all included): θ_g takes this node's own Δ."""
        return all(h.group_size <= 1 for h in self.hops)
