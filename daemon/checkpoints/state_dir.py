"""The node's state dir: held by one node at a time, and start-up errors on it said in one line.

Two nodes on one state dir would share an identity (the DHT refuses the second, late and
obscurely) and overwrite each other's checkpoints; a lock file refuses the second at once.
The lock is an flock on `state-dir/lock`, released by the kernel however the holder ends
(a kill -9 included); a restart waits a few seconds for a dying holder's processes to go.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from dtnode.daemon.config.settings import NodeSettings, SettingsError

LOCK_FILE = "lock"
LOCK_WAIT_S = 10.0  # a restart after a kill -9: the old node may still be going down


@contextlib.asynccontextmanager
async def claim_state_dir(path: Path) -> AsyncIterator[None]:
    """Hold `path` (created if missing) for the duration, or raise SettingsError naming the holder."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise state_dir_error(e, path) from None
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                if holder_running(holder) or time.monotonic() > deadline:
                    raise SettingsError(
                        "--state-dir",
                        f"{path} is in use by another dtnode (pid {holder}); give each node its own --state-dir",
                    ) from None
                await asyncio.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def holder_running(holder: str) -> bool:
    """Whether the pid the lock names is a live process other than this one: a running node
    is refused at once. A killed node's pid is gone, or a zombie, while the lock may still be
    held for a moment (by anything it forked that has not exited yet); that is worth the wait."""
    if not holder.isdigit() or int(holder) == os.getpid():
        return False
    try:
        os.kill(int(holder), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:  # a killed node its parent has not reaped yet is a zombie, not a running node
        stat = Path(f"/proc/{holder}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): a live pid
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def state_dir_error(e: OSError, state_dir: Path) -> SettingsError:
    """A local disk error at start, as one line: the path, why, and what to do."""
    where = e.filename or state_dir
    if e.errno == errno.ENOSPC:
        fix = "free some space, or give a --state-dir on a disk that has it"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "give a --state-dir this user can write"
    else:
        fix = "give a --state-dir that is a writable directory"
    return SettingsError("--state-dir", f"cannot use {where}: {e.strerror or e}; {fix}")


def startup_error(e: OSError, settings: NodeSettings) -> SettingsError:
    """An OSError while the node starts: the data's when it names a data file, else the state dir's."""
    name = str(e.filename or "")
    for option, value in (
        ("--data", settings.workload.data),
        ("--eval-data", settings.evaluation.eval_data),
        ("--tokenizer", settings.workload.tokenizer),
    ):
        if value is not None and name.startswith(str(value)):
            return SettingsError(option, f"cannot read {name}: {e.strerror or e}")
    return state_dir_error(e, Path(settings.checkpoints.state_dir))
