"""Benching members that let this node's groups down (peers/absentees.py): pure bookkeeping,
fed the typed report of a group's all-reduce."""

from __future__ import annotations

from dtnode.peers.absentees import BENCH_ROUNDS, FORGET_AFTER_ROUNDS, MAX_BENCH_ROUNDS, Absentees
from dtnode.peers.allreduce_report import AllReduceReport, PartOutcome


def _report(parts: list[tuple[str, bool, list[str]]], error: str = "ReducerAbsent: formed no group") -> AllReduceReport:
    return AllReduceReport(
        [
            PartOutcome(i, reducer, ok, included, error="" if ok else error)
            for i, (reducer, ok, included) in enumerate(parts)
        ]
    )


def test_a_silent_member_is_benched_for_doubling_rounds_and_only_once_per_bench():
    bench = Absentees()
    assert bench.strike(3, ["x"]) == ["x"]
    assert bench.strike(3, ["x"]) == []  # a round's several parts count once
    assert "x" in bench.benched(3) and "x" in bench.benched(3 + BENCH_ROUNDS)
    assert "x" not in bench.benched(4 + BENCH_ROUNDS)
    bench.strike(10, ["x"])
    assert "x" in bench.benched(10 + 2 * BENCH_ROUNDS) and "x" not in bench.benched(11 + 2 * BENCH_ROUNDS)
    for r in range(20, 200, 40):  # it fails every time it is let back in
        bench.strike(r, ["x"])
    assert bench.benched(180 + MAX_BENCH_ROUNDS) == {"x"} and not bench.benched(181 + MAX_BENCH_ROUNDS)


def test_a_grids_last_hop_leaves_out_only_a_member_struck_again_after_its_first_bench():
    """There a member left out takes its share of the mean with it (matchmaking.form_group)."""
    bench = Absentees()
    bench.strike(3, ["x", "y"])
    assert bench.benched(4) == {"x", "y"} and bench.benched_again(4) == frozenset()
    last = 3 + BENCH_ROUNDS  # the first bench's last round
    bench.strike(last, ["x"])  # within its bench (let in at a last hop, it failed): still one strike
    assert bench.benched_again(last) == frozenset() and bench.strikes("x") == 1
    bench.strike(last + 1, ["x"])  # let back in everywhere, and it let a group down again
    assert bench.benched_again(last + 1) == {"x"} == bench.benched_again(last + 1 + 2 * BENCH_ROUNDS)
    assert not bench.benched_again(last + 2 + 2 * BENCH_ROUNDS) and bench.benched(last + 1) == {"x"}


def test_a_member_that_takes_part_past_its_bench_is_forgiven_and_a_stale_one_forgotten():
    bench = Absentees()
    bench.strike(1, ["x", "y"])
    bench.took_part(2, ["x"])  # within its bench: nothing changes
    assert bench.strikes("x") == 1
    bench.took_part(1 + BENCH_ROUNDS + 1, ["x"])
    assert bench.strikes("x") == 0 and bench.strikes("y") == 1
    bench.strike(1 + BENCH_ROUNDS + FORGET_AFTER_ROUNDS + 1, ["z"])  # y's bench is long over
    assert bench.strikes("y") == 0 and bench.strikes("z") == 1


def test_the_reducer_of_a_failed_part_and_a_sender_missing_from_a_good_part_are_struck_never_oneself():
    bench = Absentees()
    members = ["me", "a", "b", "c"]
    report = _report([("me", True, ["me", "a", "b"]), ("a", True, ["me", "a", "b"]), ("c", False, [])])
    bench.observe(5, members, "me", report)
    assert bench.benched(5) == {"c"}  # c reduced nothing and sent nothing; a and b took part
    bench.observe(6, members, "me", _report([("a", False, []), ("b", False, [])], "UNAVAILABLE: refused"))
    assert bench.benched(6) == {"a", "b", "c"}  # a missing sender is only known from a good part
    bench = Absentees()
    bench.observe(5, members, "me", _report([("me", False, []), ("a", True, ["a", "b", "c"])]))
    assert "me" not in bench.benched(5) and bench.benched(5) == frozenset()


def test_a_refused_result_is_struck_in_a_pair_only():
    """A result this member refused (a re-sync that drifted, a bad weight) may be any
    contributor's doing in a group of 3 or more: its honest reducer is not benched for it."""
    bench = Absentees()
    refused = "ChunkError: the re-sync would move our values farther than this node's bound of it"
    everyone = ["me", "a", "b", "c"]
    took = ["me", "a", "b"]
    bench.observe(5, everyone, "me", _report([("me", True, took), ("a", False, []), ("b", True, took)], refused))
    assert bench.benched(5) == {"c"}  # missing from the good parts; a's refused part is not a's doing alone
    bench.observe(5, ["me", "a"], "me", _report([("me", True, ["me", "a"]), ("a", False, [])], refused))
    assert bench.benched(5) == {"a", "c"}


def test_a_member_whose_contribution_reached_this_nodes_own_part_is_not_struck_for_another_reducers_word():
    """CI (`hostile-pair`): the attacker, reducer of part 2, held the honest h1's stream to the
    deadline and returned a result of the two of them. h0 and h2 had sent their contributions to
    h1's own part and finished without the attacker; counted by the attacker's part, h1 benched
    them and averaged alone for two rounds. Its own part is its witness: only the attacker, who
    sent nothing to it, is struck."""
    bench = Absentees()
    members = ["h0", "me", "attacker", "h2"]
    honest = ["h0", "me", "h2"]
    report = _report(
        [("h0", True, honest), ("h2", True, honest), ("attacker", True, ["me", "attacker"]), ("me", True, honest)]
    )
    bench.observe(1, members, "me", report)
    assert bench.benched(1) == {"attacker"}
    client = Absentees()  # a node that reduces no part has only the reducers' word
    client.observe(1, members, "me", _report([("h0", True, honest), ("attacker", True, ["me", "attacker"])]))
    assert client.benched(1) == {"h0", "h2", "attacker"}


def test_a_strike_taken_back_the_same_round_leaves_the_member_as_it_was_before_it():
    """A follower strikes a leader it passes over, then may take that leader's list while it
    settles (matchmaking.form_group): the strike is taken back, and earlier ones stand."""
    bench = Absentees()
    bench.strike(3, ["x"])
    bench.pardon(3, ["x"])
    assert not bench.benched(3) and bench.strikes("x") == 0
    bench.strike(3, ["y"])
    bench.strike(3 + BENCH_ROUNDS + 1, ["y"])  # struck again past its first bench
    bench.pardon(3 + BENCH_ROUNDS + 1, ["y"])
    assert not bench.benched(3 + BENCH_ROUNDS + 1) and bench.strikes("y") == 1
    bench.pardon(20, ["y", "z"])  # no strike this round: nothing to take back
    assert bench.strikes("y") == 1 and bench.strikes("z") == 0
