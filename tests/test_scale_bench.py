"""The scale benchmark's tally of a run's histories (tests/bench/scale.py): what its table counts."""

from __future__ import annotations

from tests.bench.scale import RoundTally, round_lines


def entry(round_no: int, theta: str = "a", outcome: str = "full", reasons: list[str] | None = None) -> dict:
    phases = {"matchmaking": 2.0, "allreduce": 1.0}
    return {"round": round_no, "params_sha256": theta, "outcome": outcome, "reasons": reasons or [], "phases_s": phases}


def test_a_round_a_node_skipped_is_neither_full_nor_agreed_and_the_rounds_end_where_every_node_reached():
    """A node that fell behind and caught up past a round by a download has no entry for it: the
    round counts, as neither full nor agreed (before, it dropped out of the table: 8 of 32 nodes
    skipped a round and the row counted 9 rounds of 10). Rounds past the last one every node
    reached (a run capped mid-round) are not counted."""
    histories = {
        "n0": [entry(0), entry(1), entry(2), entry(3)],
        "n1": [entry(0), entry(2, "b"), entry(3)],  # skipped round 1; round 2 on another θ_g
        "n2": [entry(0, outcome="partial", reasons=["dropped_sender"]), entry(1), entry(2)],  # capped after 2
    }
    tally = RoundTally.of(histories)
    assert tally.rounds == [0, 1, 2]
    assert tally.full == [False, False, True]
    assert tally.hashes == [1, 1, 2]
    assert tally.agreed == [True, False, False]


def test_a_round_line_says_who_was_full_which_theta_they_hold_and_why_the_rest_were_not():
    by_round = {
        0: [entry(0), entry(0, "b", "partial", ["dropped_sender"]), entry(0, "b", "partial")],
        1: [entry(1), entry(1)],
    }
    first, second = round_lines(by_round, 3)
    assert first.startswith("  round 0: 1/3 full, 2 θ_g (2, 1), not full: {'alone': 1, 'dropped_sender': 1};")
    assert second.startswith("  round 1: 2/2 full (1 without this round), 1 θ_g;")
