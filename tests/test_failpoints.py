"""Failpoints kill the process only where and when they are armed (the chaos harness relies on it)."""

import os
import signal
import subprocess
import sys

import pytest

from dtnode.peers import failpoints

PROBE = "from dtnode.peers import failpoints; failpoints.reach('sending', 1); failpoints.reach('reducing', 2); " \
        "print('survived', flush=True); failpoints.reach('sending', 2); print('not reached')"


def _run(spec: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
    if spec is not None:
        env[failpoints.ENV] = spec
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)


def test_an_armed_failpoint_kills_at_its_point_and_round_only():
    died = _run("sending@2")
    assert died.returncode == -signal.SIGKILL
    assert died.stdout.strip() == "survived"
    assert "failpoint sending@2 reached" in died.stderr


def test_unarmed_failpoints_do_nothing():
    assert _run(None).stdout.split() == ["survived", "not", "reached"]


@pytest.mark.parametrize("spec", ["sending", "sending@", "nowhere@2", "reducing@two"])
def test_a_malformed_spec_is_refused_at_import(spec):
    with pytest.raises(ValueError):
        failpoints._parse(spec)
