import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).parent))  # test helpers (harness modules) import by name

from nodes import NodeProcess  # a harness module, importable once the path is set

NODE_LINES_ON_FAILURE = 30  # of each node the failed test started, its last lines go in the report


@pytest.fixture(autouse=True)
def _forget_earlier_tests_nodes():
    NodeProcess.started.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the last lines of every node it started: in CI no node
    log survives the run, and a timed-out wait alone does not say what the swarm was doing."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for node in NodeProcess.started:
            tail = "\n".join(node.lines[-NODE_LINES_ON_FAILURE:])
            report.sections.append((f"node {node.name} (pid {node.proc.pid}), its last lines", tail))
        for node in NodeProcess.started:  # short, and last: a long report is cut in its middle
            report.sections.append((f"node {node.name}, its rounds", node.rounds_summary()))


@pytest.fixture
def cleanup():
    """Node processes a test started; killed at the end whatever happened."""
    nodes = []
    yield nodes
    for node in nodes:
        node.kill()
        # keep each node's log beside its state dir for post-mortems
        Path(str(node.state_dir) + ".log").write_text(node.output)
