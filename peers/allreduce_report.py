"""What one member's butterfly all-reduce did, part by part: the typed record its caller reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PartOutcome:
    part: int
    reducer: str
    ok: bool
    included: list[str] = field(default_factory=list)
    total_weight: float = 0.0
    length: int = 0
    error: str = ""  # "code: detail" (part_stream.error_code)
    reducer_gone: bool = False  # failed for want of its reducer, which is in no group with anyone (stand_in.py)
    stood_in_for: str = ""  # the part's reducer, not in the group, whose part `reducer` reduced instead (stand_in.py)

    @property
    def error_code(self) -> str:
        return self.error.split(":", 1)[0].strip()


@dataclass
class AllReduceReport:
    parts: list[PartOutcome]
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    retried: list[str] = field(default_factory=list)  # error codes of streams that broke and were sent again

    @property
    def included_peers(self) -> list[str]:
        """Peers whose contribution reached every part that succeeded."""
        ok = [set(p.included) for p in self.parts if p.ok and p.included]
        return sorted(set.intersection(*ok)) if ok else []

    @property
    def failed_parts(self) -> list[PartOutcome]:
        return [p for p in self.parts if not p.ok]

    def weight_after(self, own_weight: float) -> float:
        """The weight the averaged buffer stands for: the parts' total weights, by length.

        Parts whose reducer failed hold this member's own values and count `own_weight`.
        Moshpit hops carry this forward so token weighting survives several hops.
        """
        total = sum(p.length for p in self.parts)
        if total == 0:
            return own_weight
        return sum((p.total_weight if p.ok else own_weight) * p.length for p in self.parts) / total
