"""The convergence benchmark's own bookkeeping (tests/bench/convergence.py), which decides what
its tables claim: where the reference DiLoCo's rounds end (with H ramped up, -hrN), and which run
stands for each side at its best."""

from __future__ import annotations

import pytest

from tests.bench.convergence import Config, Reference, Result, best_of_each_kind, run_one


def test_rounds_end_every_h_steps_and_a_ramp_grows_them_to_h():
    assert Reference(h=10).round_ends(35) == [10, 20, 30, 35]  # the run's last step ends a round
    assert Reference(h=10, h_ramp=4).round_ends(40) == [2, 7, 15, 25, 35, 40]  # 2, 5, 8 (7.5 rounds to even), 10
    assert Reference(h=10, h_ramp=10).round_ends(60)[:4] == [1, 3, 6, 10]
    assert Reference().round_ends(100) == []  # data-parallel: no rounds


def test_each_kind_is_represented_by_its_lowest_held_out_loss():
    def result(run: str, loss: float) -> Result:
        return Result(run, "text", loss, 0.0, 1.0, 1)

    rows = [
        result("dp", 2.0),
        result("dp-lr0.012-muon", 1.44),
        result("dp-lr0.008", 1.55),
        result("int8-h10-lr0.016-om0.6-muon", 1.48),
        result("int8-h10", 1.98),
        result("moshpit-int8-h10-muon", 1.50),
        result("int8-h50-muon", 2.01),
        result("diloco-h10-lr0.016-olr2-om0-sparse-efd0.95-muon", 1.65),
        result("diloco-h10-lr0.024-om0.6-muon", 1.47),
    ]
    assert [r.run for r in best_of_each_kind(rows)] == [
        "dp-lr0.012-muon",
        "int8-h10-lr0.016-om0.6-muon",
        "moshpit-int8-h10-muon",
        "int8-h50-muon",
        "diloco-h10-lr0.016-olr2-om0-sparse-efd0.95-muon",
        "diloco-h10-lr0.024-om0.6-muon",
    ]


def test_a_ramp_with_a_delayed_mean_is_refused():
    with pytest.raises(SystemExit, match="do not combine"):
        run_one("diloco-h10-delay5-hr4", Config("tiny", 16, 64, 100, 4, 1e-3, 0.7, 10, 8, 2, "cpu"), "text", None, None)  # type: ignore[arg-type]
