"""A stand-in reducer for a part whose reducer is not in the group.

A plan names a reducer for every part; a member that its group-mates counted in but that
formed another group (or died, or never formed one) leaves its part without one. Before, each
member then kept its own values there, and its group's members carried different values of that
part into the next hop: complete groups of the grid's last hop ended on different θ_g (a hop-0
group of three that formed as two split 32 nodes on 2 cores four ways). Each member that finds
the part's reducer gone (`STAND_IN_CODES`) now sends its slice to the part's stand-in instead:
the next reducer in the plan's order, the same for every member. The stand-in, having found the
same, reduces the part too, and every member that takes its mean leaves with the same bytes. A
member whose stream finds no stand-in in time (it has not found the reducer gone, or is gone as
well) keeps its own values there, as before.
"""

from __future__ import annotations

from .plan import GroupPlan, Member

# what a part's stream ended with when its reducer is not in the group: it formed no group with
# this member (`presence.py`), said it formed others (NOT_FOUND, but not a NOT_FOUND that says it
# left only this member out: `wire.LEFT_OUT_METADATA`), or could not be reached
STAND_IN_CODES = frozenset({"ReducerAbsent", "NOT_FOUND", "UNAVAILABLE"})


def stand_in(plan: GroupPlan, part: int) -> Member | None:
    """The reducer that stands in for part `part`'s: the next member of the plan with a part of
    its own, in the plan's order and around; None where the part's reducer is the only one."""
    n = len(plan.members)
    for step in range(1, n):
        i = (part + step) % n
        if plan.parts[i][1] > 0:
            return plan.members[i]
    return None
