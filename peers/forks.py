"""One lock around every child process this node starts while its other threads run.

hivemind's DHT is a forked child that never execs, and a node starts it while its training
thread starts the local ranks (`subprocess.Popen`). A fork copies every open descriptor, the
close-on-exec ones too, and a child that never execs keeps them for its life. A DHT forked while
a Popen's pipes were open kept the write end of the pipe through which Popen learns that its
child has exec'd: Popen waited for ever (a 2-rank node hung at its start, 1 start in 12 here,
and once in CI). Each fork or Popen holds this lock until its own pipes are closed.
"""

from __future__ import annotations

import subprocess
import threading
from typing import Any

FORK_LOCK = threading.Lock()


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """`subprocess.Popen`, never while another thread of this process forks under FORK_LOCK."""
    with FORK_LOCK:
        return subprocess.Popen(args, **kwargs)


__all__ = ["FORK_LOCK", "popen"]
