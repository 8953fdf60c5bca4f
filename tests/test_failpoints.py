"""Failpoints kill the process only where and when they are armed (the chaos harness relies on it)."""

import os
import signal
import subprocess
import sys

import pytest

from dtnode.peers import failpoints

PROBE = (
    "from dtnode.peers import failpoints; failpoints.reach('sending', 1); failpoints.reach('reducing', 2); "
    "print('survived', flush=True); failpoints.reach('sending', 2); print('not reached')"
)


def _run(spec: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
    if spec is not None:
        env[failpoints.ENV] = spec
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_an_armed_failpoint_kills_at_its_point_and_round_only():
    died = _run("sending@2")
    assert died.returncode == -signal.SIGKILL
    assert died.stdout.strip() == "survived"
    assert "failpoint sending@2 reached" in died.stderr


def test_unarmed_failpoints_do_nothing():
    assert _run(None).stdout.split() == ["survived", "not", "reached"]


@pytest.mark.parametrize(
    "spec", ["sending", "sending@", "nowhere@2", "reducing@two", "reducing@2:5", "outer-phase@2:x"]
)
def test_a_malformed_spec_is_refused_at_import(spec):
    with pytest.raises(ValueError):
        failpoints._parse(spec)


def test_a_pausing_failpoint_holds_the_caller_for_its_seconds_in_its_round_only():
    """The pause is an asyncio sleep of the armed seconds, in the armed round only (the sleeps
    are recorded, not timed: the event loop itself is never blocked)."""
    probe = (
        "import asyncio; from dtnode.peers import failpoints\n"
        "slept = []\n"
        "async def record(seconds): slept.append(seconds)\n"
        "failpoints.asyncio.sleep = record\n"
        "async def main():\n"
        "    await failpoints.pause('outer-phase', 1); await failpoints.pause('outer-phase', 2)\n"
        "    await failpoints.pause('outer-phase', 3); print(slept)\n"
        "asyncio.run(main())"
    )
    env = {**os.environ, failpoints.ENV: "outer-phase@2:7"}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "[7.0]", done.stdout + done.stderr
    assert "failpoint outer-phase@2 reached: pausing 7s" in done.stderr


@pytest.mark.long_swarms  # about 16 s: outside the default suite's 10 minutes, run by .ci/run
def test_healthz_turns_503_while_the_training_thread_is_frozen(tmp_path, cleanup):
    """A hung training thread (the stall-training failpoint holds it 10 s in round 1): the node
    still answers HTTP, but /healthz says 503 with the reason once no step came for
    --health-stall-s, and 200 again once steps resume."""
    import json
    import urllib.error
    import urllib.request

    from nodes import FAST, NodeProcess, wait_until

    node = NodeProcess.join(
        "frozen", tmp_path, *FAST, "--health-stall-s", "3", env={failpoints.ENV: "stall-training@1:10"}
    )
    cleanup.append(node)

    def health() -> tuple[int, dict] | None:
        try:
            with urllib.request.urlopen(node.http_url + "/healthz", timeout=5) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
        except OSError:
            return None

    sick = wait_until(lambda: (h := health()) and h[0] == 503 and h, 120, "a 503 from /healthz")
    assert sick[1]["ok"] is False and "no inner step for" in sick[1]["detail"], sick
    node.wait_for_line(r"failpoint stall-training@1 reached", timeout=10)
    wait_until(lambda: (h := health()) and h[0] == 200 and h, 120, "/healthz back to 200")
    assert node.status()["state"] in ("training", "averaging")


def test_every_test_hook_is_read_by_the_failpoints_module_alone():
    """DTNODE_TEST_* hooks change what a node does: they are read in one module, where a reader
    of the code finds every one (the trainer's slowdown and step floor included)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readers = {
        str(path.relative_to(root))
        for package in ("daemon", "peers", "ops")
        for path in (root / package).rglob("*.py")
        if re.search(r"environ(\.get)?\(?\[?\s*['\"]DTNODE_TEST_|_hook_number\(\"DTNODE_TEST_", path.read_text())
    }
    assert readers == {"peers/failpoints.py"}, readers
