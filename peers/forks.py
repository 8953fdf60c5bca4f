"""One lock around every child process started while other threads of this process run.

A fork that never execs copies every open descriptor, the close-on-exec ones too, and keeps
them for its life. hivemind's DHT process is such a fork (the node ran one until its DHT moved
onto its own loop, peers/dht_in_process.py; the tests' harness still starts them): forked while
a Popen's pipes were open, it kept the write end of the pipe through which Popen learns that its
child has exec'd, and Popen waited for ever (a 2-rank node hung at its start, 1 start in 12 here,
and once in CI). Each such fork and each Popen of a local rank holds this lock until its own
pipes are closed.
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
