"""hivemind DHTs started in a test as a node starts its own: forked under the fork lock and
waited for with a deadline, another started if one never gets ready; and scenarios on DHTs run
in a fresh process of their own.

hivemind's DHT is a forked child of the (threaded) test process; once in a while one starts but
never answers its parent (seen in the suite: 300 s in `hivemind.DHT(start=True)`, which waits
without a deadline, then pytest's timeout; three in a row never ready, one dying of a fatal
error). A scenario run through `run_in_fresh_process` forks its DHTs from a process that has run
nothing else, as a node does."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P

from dtnode.peers.dht_in_process import InProcessDHT
from dtnode.peers.dht_start import start_dht
from dtnode.peers.forks import FORK_LOCK
from dtnode.peers.identity import identity_key

READY_S = 30.0
# a scenario in a fresh process that has not ended by then is stuck on a DHT that stopped
# answering (it takes a few seconds); it runs again in another. An assertion that fails is not retried.
SCENARIO_S = 90.0
ATTEMPTS = 3


def _die_with_parent() -> None:
    """In a forked child (a hivemind DHT process): get SIGKILL when its parent dies, even by
    kill -9, so that a test that dies leaves no DHT behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: nothing to do
    if os.getppid() == 1:  # the parent died before the line above ran
        os._exit(1)


def _forked_dht(kwargs: dict, wait_s: float) -> DHT:
    """hivemind's DHT process, forked under FORK_LOCK (see peers/forks.py) and ready within
    `wait_s`; TimeoutError, with the process stopped, if it is not."""
    dht = DHT(start=False, **kwargs)
    with FORK_LOCK:
        dht.run_in_background(await_ready=False)
    try:
        dht.wait_until_ready(wait_s)
    except TimeoutError:
        dht.terminate()
        dht.join(5)
        raise
    return dht


def ready_dht(**kwargs: Any) -> DHT:
    """A running DHT with these hivemind.DHT arguments; AssertionError after three that never got ready."""
    for _ in range(3):
        try:
            return _forked_dht(kwargs, READY_S)
        except TimeoutError:
            continue
    raise AssertionError(f"three DHTs in a row were not ready within {READY_S:g}s")


async def signed_dhts(directory: Path, names: tuple[str, ...]) -> list[tuple[InProcessDHT, RSASignatureValidator]]:
    """One DHT per name, each with an identity key of its own and a node's validators (the
    swarm's record shapes, owner signatures), all joined through the first: (DHT, its validator)."""
    started: list[tuple[InProcessDHT, RSASignatureValidator]] = []
    for name in names:
        path = directory / f"{name}.key"
        P2P.generate_identity(str(path))
        validator = RSASignatureValidator(identity_key(path))
        initial = [str(a) for a in started[0][0].get_visible_maddrs()] if started else []
        dht = await start_dht(initial, "127.0.0.1", 0, None, 60, str(path), validator, fresh_identity=True)
        started.append((dht, validator))
    return started


async def freezable_dht(nodes: list[tuple[InProcessDHT, RSASignatureValidator]]) -> DHT:
    """A hivemind.DHT process joined through the first of `nodes`, which a test can freeze alone
    (`sigstopped`): it keeps its connections and answers nothing, as a paused peer does. Started off
    this loop, which answers its bootstrap."""
    return await asyncio.to_thread(ready_dht, initial_peers=[str(m) for m in nodes[0][0].get_visible_maddrs()])


@contextlib.contextmanager
def sigstopped(process: DHT) -> Iterator[None]:
    """`process` stopped (SIGSTOP) for the block, continued after it whatever happens."""
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)


async def shut_down(nodes: list[tuple[InProcessDHT, RSASignatureValidator]], *others: DHT) -> None:
    """The DHTs a scenario started, the processes first."""
    for process in others:
        process.shutdown()
    for dht, _ in reversed(nodes):
        await dht.shutdown()


def run_in_fresh_process(
    directory: Path, scenario: Callable[[Path], Awaitable[None]], seconds: float = SCENARIO_S
) -> None:
    """Run the module-level coroutine function `scenario(folder)` in a fresh interpreter, where
    the DHTs it starts are forked from a process with no other test's threads in it.

    The test process has run hundreds of tests by then (gRPC pollers, thread pools, event loops
    on other threads), and a DHT forked from it sometimes never answers or dies at its start (CI:
    three forked in a row were never ready, one crashing with a fatal error). A scenario that is
    stuck past `seconds`, or whose process dies by a signal, runs again in another fresh process,
    up to ATTEMPTS times; one that raises fails the test with its traceback, and is not retried."""
    source = Path(inspect.getfile(scenario)).resolve()
    outcomes: list[str] = []
    for attempt in range(ATTEMPTS):
        folder = directory / f"attempt-{attempt}"
        folder.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-c", _RUNNER, str(Path(__file__).parent), str(source), scenario.__name__, str(folder)]
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = child.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            _kill_tree(child)
            outcomes.append(f"stuck past {seconds:g}s")
            continue
        text = output.decode(errors="replace")
        if child.returncode == 0:
            return
        if child.returncode < 0:  # a crash (a signal), not a failed assertion
            outcomes.append(f"died by signal {-child.returncode}: {text[-2000:]}")
            continue
        raise AssertionError(f"the scenario {scenario.__name__} failed:\n{text[-6000:]}")
    raise AssertionError(f"{ATTEMPTS} fresh processes in a row did not finish {scenario.__name__}: {outcomes}")


# the fresh interpreter's program: this folder importable (the scenario's module imports its
# harnesses by name), every DHT it forks killed with it, the scenario's module loaded from its file
_RUNNER = """
import asyncio, importlib.util, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from dht_harness import die_with_parent_in_forks
die_with_parent_in_forks()
spec = importlib.util.spec_from_file_location("scenario_" + Path(sys.argv[2]).stem, sys.argv[2])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
asyncio.run(getattr(module, sys.argv[3])(Path(sys.argv[4])))
"""


def die_with_parent_in_forks() -> None:
    """Every process this one forks from now on (hivemind's DHT) gets SIGKILL when this one dies,
    as a node's DHT does: a scenario killed for being stuck leaves no DHT behind."""
    os.register_at_fork(after_in_child=_die_with_parent)


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    """Kill a scenario's process and everything under it (its DHTs, their p2pd daemons)."""
    with contextlib.suppress(psutil.Error):
        below = psutil.Process(process.pid).children(recursive=True)
        for proc in [psutil.Process(process.pid), *below]:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    process.wait(10)
