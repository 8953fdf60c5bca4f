"""Members that let this node's group down, benched for a few rounds: not waited for as a
leader, not named in a group, not counted missing.

A member can register for every group and then take no part: it sends no chunk, reduces no
part, or (as the lowest-ranked registrant) closes no list. Each such round cost its group a
deadline, left the part it owned to each member's own values (the honest θ_g parted and had to
be re-synced) and, where it led, a grace. Registering is free, and nothing in a registration
says who will show up; what a node can check is what happened in its own groups. So a leader
passed over, a member whose part failed for want of it (it formed no group with this member,
refused the connection or never answered), or whose contribution is missing from the part this
node reduced (a node that reduces none: from a part that succeeded), and in a pair a member
whose part this node refused (a re-sync that moved θ_g farther than the swarm's recent outer
steps, say: in a pair only the other member can cause it), is struck out by each member that
saw it (every honest member of that group did), and benched:

- from the strike on, for BENCH_ROUNDS rounds after the one it let down, doubled at each
  further strike (up to MAX_BENCH_ROUNDS): a member that fails every time it is let back in
  costs its group one round in 2, 4, 8, 16, ... rather than every round;
- a bench ends on its own clock; a member that then takes part cleanly is forgiven its strikes;
- in the last hop of a grid of several hops, a first strike does not bench: a member left out
  there takes its share of the swarm's mean with it (nothing after the last hop brings it in), so
  its group's θ_g parts from the swarm's whether it is left out or fails. Let back in, an honest
  member (32 nodes on 2 cores: taken for absent once, in a hop it made late) brings its share; a
  hostile one costs its last-hop group the rounds of its first bench and the one after (a strike
  during a bench does not count), until its second strike benches it there too.

An honest member that crashed, stalled or restarted is benched too, for BENCH_ROUNDS rounds:
it averages alone meanwhile (as it would have, being away), and is back in the round after.
A bench is this node's own view; a list in force that names a benched member still stands (a
leader that does not bench it named it), and a list that led past a registrant its reader
benched is held until its members settled on it (`ListSettling.hold`): members that do not bench
that registrant wait for it as their leader, and take the list it closes. A list of one is held
too: the benched leader does not bench this node, and names it; had this node averaged alone, it
would be struck for its absence and bench this node back, and two honest peers would take turns
benching each other (CI: a 3-peer swarm ended a run with two θ_g so).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from .allreduce_report import AllReduceReport

log = logging.getLogger(__name__)

BENCH_ROUNDS = 2  # rounds after the one it let down that a first-time absentee sits out
MAX_BENCH_ROUNDS = 16
# failures of a part that say its reducer was not there: it formed no group with this member
# (failure_detector.py), refused the connection, or never answered in time
ABSENCE_CODES = frozenset({"ReducerAbsent", "UNAVAILABLE", "DEADLINE_EXCEEDED", "TimeoutError"})
FORGET_AFTER_ROUNDS = 64  # a bench this long over is forgotten, strikes and all (ids are free: bounded)


@dataclass
class _Strikes:
    count: int
    until_round: int  # benched in every round up to this one (inclusive)


class Absentees:
    """The members this node benches, by round (see the module)."""

    def __init__(self) -> None:
        self._strikes: dict[str, _Strikes] = {}

    def strike(self, round_no: int, peers: Iterable[str]) -> list[str]:
        """Bench these members from `round_no` on; returns the ones newly benched."""
        newly = []
        for gone in [p for p, s in self._strikes.items() if s.until_round < round_no - FORGET_AFTER_ROUNDS]:
            del self._strikes[gone]
        for peer in peers:
            old = self._strikes.get(peer)
            if old is not None and old.until_round >= round_no:
                continue  # one strike per bench: a round's several parts and hops count once
            count = 1 if old is None else old.count + 1
            rounds = min(BENCH_ROUNDS << (count - 1), MAX_BENCH_ROUNDS)
            self._strikes[peer] = _Strikes(count, round_no + rounds)
            newly.append(peer)
        if newly:
            log.info(
                "round %d: benched %s (it let this node's group down: no list, no part or no contribution)",
                round_no,
                ", ".join(f"{p[-6:]} to round {self._strikes[p].until_round}" for p in newly),
            )
        return newly

    def observe(self, round_no: int, members: Iterable[str], me: str, report: AllReduceReport) -> None:
        """What one group's all-reduce showed of its members, as this member saw it: the
        reducers of parts that failed, and the members whose contribution it did not see arrive
        (`_contributed`), are struck; the others took part."""
        others = set(members) - {me}
        # a part that failed for want of its reducer is its reducer's doing; one whose result
        # this member refused (a bad weight, a result too long, a re-sync that drifted) may be
        # any contributor's, so it counts only in a pair, where the only other member is both
        missing = {p.reducer for p in report.failed_parts if len(others) == 1 or p.error_code in ABSENCE_CODES}
        missing |= {p.stood_in_for for p in report.parts if p.stood_in_for}  # its part had to go to a stand-in
        seen = _contributed(report, me)
        if seen is not None:
            missing |= others - seen
        self.strike(round_no, sorted(missing & others))
        self.took_part(round_no, others - missing)

    def pardon(self, round_no: int, peers: Iterable[str]) -> None:
        """Take back this round's strike of these members: a leader passed over whose list this
        node then took while settling did not let its group down."""
        for peer in peers:
            old = self._strikes.get(peer)
            if old is None or old.until_round < round_no:
                continue
            if old.count == 1:
                del self._strikes[peer]
            else:  # its earlier strikes stand, its bench is over
                self._strikes[peer] = _Strikes(old.count - 1, round_no - 1)

    def took_part(self, round_no: int, peers: Iterable[str]) -> None:
        """These members took part cleanly: past their bench, their strikes are forgiven."""
        for peer in peers:
            old = self._strikes.get(peer)
            if old is not None and old.until_round < round_no:
                del self._strikes[peer]

    def benched(self, round_no: int) -> frozenset[str]:
        return frozenset(p for p, s in self._strikes.items() if s.until_round >= round_no)

    def benched_again(self, round_no: int) -> frozenset[str]:
        """The members benched in this round for a second strike or more: what a grid's last
        hop leaves out (`Matchmaker.form_group`). There a member left out takes its share of the
        mean with it and parts θ_g anyway, so a first strike (an honest peer taken for absent on a
        loaded host, a restart) is let back in, and only a member struck again after its first
        bench is not."""
        return frozenset(p for p, s in self._strikes.items() if s.until_round >= round_no and s.count > 1)

    def strikes(self, peer: str) -> int:
        s = self._strikes.get(peer)
        return s.count if s is not None else 0


def _contributed(report: AllReduceReport, me: str) -> set[str] | None:
    """The members whose contribution this node saw arrive, or None where no part succeeded
    (nobody is then missing for want of a contribution).

    Where this node reduced a part that succeeded, that part is its witness: a member whose
    stream reached it took part, and its absence from another reducer's result is that
    reducer's word alone. (A hostile reducer held this node's stream to the deadline, then
    returned a result of the two of them; counted by every part, this node benched the two
    honest members that had finished without it and averaged alone: CI, `hostile-pair`.)
    A node that reduced nothing (a client) has only the reducers' word: the members in every
    part that succeeded."""
    own = [set(p.included) for p in report.parts if p.reducer == me and p.ok and p.included]
    if own:
        return set.intersection(*own)
    if any(p.ok for p in report.parts):
        return set(report.included_peers)
    return None
