"""`dtnode local`: a whole swarm on this host, the newcomer's first run.

Node 0 starts the swarm; the others join through the line it prints. Each node's output is
prefixed with its name. Ctrl-C (or SIGTERM) is passed to every node, which stops cleanly.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path
from typing import Any

from dtnode.daemon.checkpoints.file_format import list_checkpoints
from dtnode.daemon.config.settings import flag

JOIN_LINE = re.compile(r"dtnode join --peer ([^\s\"]+)")  # plain or inside a JSON log line
COLORS = ["36", "33", "35", "32", "34", "31"]


def threads_per_rank(nodes: int, ranks_per_node: int, cores: int) -> int:
    """Torch threads for each rank of `dtnode local`'s nodes: the host's cores shared among
    them all. Each torch takes every core by default, and N nodes on one host then run N x cores
    threads whose parallel ops wait on each other (`dtnode local --nodes 3` of tiny on 2 cores:
    30k tok/s a node with torch's default, 41k with one thread each)."""
    return max(1, cores // (nodes * ranks_per_node))


def finished_before(base_dir: Path, max_rounds: int | None) -> int | None:
    """The outer step an earlier `dtnode local` in `base_dir` ended at, when it is already the
    run's last (`max_rounds`); None when there is a round left to train. node0 starts the swarm
    from its own state, so its newest checkpoint is where a second run would begin: a node
    there stops at once (the run is over), which a newcomer running `make swarm` twice took for
    a swarm that does nothing."""
    if max_rounds is None:
        return None
    found = list_checkpoints(base_dir / "node0")
    return found[0][0] if found and found[0][0] >= max_rounds else None


def _argv(values: dict[str, Any]) -> list[str]:
    argv = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv.append(flag(name) if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            argv += [flag(name), str(value)]
    return argv


async def _pump(name: str, index: int, stream: asyncio.StreamReader, on_line=None) -> None:
    color = COLORS[index % len(COLORS)]
    prefix = f"\033[{color}m{name:>6}\033[0m | " if sys.stdout.isatty() else f"{name:>6} | "
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip()
        print(prefix + text, flush=True)
        if on_line:
            on_line(text)


async def _run(nodes: int, base_dir: str, values: dict[str, Any], http_port: int) -> int:
    values = dict(values)
    given = values.pop("status_port", None)  # like --http-port: one port per node, counting up
    status_port = int(given) if given is not None else None  # checked by load_settings already
    common = _argv(values) + ["--host", "127.0.0.1", "--dht-port", "0", "--grpc-port", "0", "--min-peers", str(nodes)]
    procs: list[asyncio.subprocess.Process] = []
    pumps: list[asyncio.Task] = []
    joined = asyncio.get_running_loop().create_future()
    stopping = False

    def stop_all() -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGINT)
        if not joined.done():
            joined.cancel()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop_all)
    loop.add_signal_handler(signal.SIGTERM, stop_all)

    async def spawn(i: int, extra: list[str]) -> None:
        state_dir = Path(base_dir) / f"node{i}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-u",
            "-m",
            "dtnode",
            "join",
            *common,
            "--state-dir",
            str(state_dir),
            "--http-port",
            str(http_port + i if http_port else 0),
            *(["--status-port", str(status_port + i if status_port else 0)] if status_port is not None else []),
            *extra,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(proc)
        assert proc.stdout is not None  # asked for above (PIPE)

        def watch(line: str) -> None:
            m = JOIN_LINE.search(line)
            if i == 0 and m and not joined.done():
                joined.set_result(m.group(1))

        pumps.append(asyncio.create_task(_pump(f"node{i}", i, proc.stdout, watch)))

    await spawn(0, ["--new-swarm"])
    first = procs[0]
    try:
        waiter = asyncio.ensure_future(first.wait())
        done, _ = await asyncio.wait({joined, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if joined not in done or joined.cancelled():
            await asyncio.gather(*pumps, return_exceptions=True)
            print("dtnode local: the first node exited before it was reachable", file=sys.stderr)
            return first.returncode or 1
        address = joined.result()
        for i in range(1, nodes):
            if not stopping:
                await spawn(i, ["--peer", address])
    except asyncio.CancelledError:
        pass
    codes = await asyncio.gather(*(p.wait() for p in procs))
    await asyncio.gather(*pumps, return_exceptions=True)
    failed = [c for c in codes if c not in (0, -signal.SIGINT)]
    return failed[0] if failed else 0


def run_local(nodes: int, base_dir: str, values: dict[str, Any], http_port: int = 0) -> int:
    import uvloop

    return uvloop.run(_run(nodes, base_dir, values, http_port))
