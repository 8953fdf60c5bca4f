"""The short chaos set (one trial per scenario) in the default suite; the full set, 20
trials per scenario, runs with `-m chaos_full` or `python -m tests.chaos.runner`."""

import pytest

from chaos.harness import SCENARIOS

SHORT = ["kill9-allreduce", "sigstop", "kill9-checkpoint-write"]


@pytest.mark.parametrize("name", SHORT)
def test_short_chaos_set(tmp_path, name):
    trial = SCENARIOS[name](tmp_path)
    assert trial.fired, trial
    assert trial.passed, trial.notes


@pytest.mark.chaos_full
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("trial", range(20))
def test_full_chaos_set(tmp_path, name, trial):
    result = SCENARIOS[name](tmp_path)
    assert result.fired and result.passed, result.notes
