import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).parent))  # test helpers (harness modules) import by name


@pytest.fixture
def cleanup():
    """Node processes a test started; killed at the end whatever happened."""
    nodes = []
    yield nodes
    for node in nodes:
        node.kill()
        # keep each node's log beside its state dir for post-mortems
        Path(str(node.state_dir) + ".log").write_text(node.output)
