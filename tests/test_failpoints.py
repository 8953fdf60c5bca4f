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


@pytest.mark.parametrize("spec", ["sending", "sending@", "nowhere@2", "reducing@two", "reducing@2:5",
                                  "outer-phase@2:x"])
def test_a_malformed_spec_is_refused_at_import(spec):
    with pytest.raises(ValueError):
        failpoints._parse(spec)


def test_a_pausing_failpoint_holds_the_caller_for_its_seconds_in_its_round_only():
    probe = ("import asyncio, time; from dtnode.peers import failpoints\n"
             "async def main():\n"
             "    t = time.monotonic(); await failpoints.pause('outer-phase', 1); a = time.monotonic() - t\n"
             "    t = time.monotonic(); await failpoints.pause('outer-phase', 2); b = time.monotonic() - t\n"
             "    print(f'{a:.1f} {b:.1f}')\n"
             "asyncio.run(main())")
    env = {**os.environ, failpoints.ENV: "outer-phase@2:1"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    first, second = map(float, done.stdout.split())
    assert first < 0.5 and second >= 1.0, done.stdout + done.stderr
    assert "failpoint outer-phase@2 reached: pausing 1s" in done.stderr
