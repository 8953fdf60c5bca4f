"""hivemind DHTs started in a test process as a node starts its own: forked under the fork lock
and waited for with a deadline, another started if one never gets ready.

hivemind's DHT is a forked child of the (threaded) test process; once in a while one starts but
never answers its parent (seen in the suite: 300 s in `hivemind.DHT(start=True)`, which waits
without a deadline, then pytest's timeout)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P

from dtnode.peers.dht_start import _forked_dht, start_dht
from dtnode.peers.identity import identity_key

READY_S = 30.0
# a scenario on in-process DHTs that has not ended by then is stuck on a DHT that stopped
# answering its parent (seen in CI: 300 s awaiting a store, then pytest's timeout); it runs
# again on fresh ones. An assertion that fails is not retried.
SCENARIO_S = 90.0
ATTEMPTS = 3


def ready_dht(**kwargs: Any) -> DHT:
    """A running DHT with these hivemind.DHT arguments; AssertionError after three that never got ready."""
    for _ in range(3):
        try:
            return _forked_dht(kwargs, READY_S)
        except TimeoutError:
            continue
    raise AssertionError(f"three DHTs in a row were not ready within {READY_S:g}s")


async def signed_dhts(directory: Path, names: tuple[str, ...]) -> list[tuple[DHT, RSASignatureValidator]]:
    """One DHT per name, each with an identity key of its own and a node's validators (the
    swarm's record shapes, owner signatures), all joined through the first: (DHT, its validator)."""
    started: list[tuple[DHT, RSASignatureValidator]] = []
    for name in names:
        path = directory / f"{name}.key"
        P2P.generate_identity(str(path))
        validator = RSASignatureValidator(identity_key(path))
        initial = [str(a) for a in started[0][0].get_visible_maddrs()] if started else []
        dht = await start_dht(initial, "127.0.0.1", 0, None, 60, str(path), validator, fresh_identity=True)
        started.append((dht, validator))
    return started


def run_on_fresh_dhts(
    directory: Path,
    start: Callable[[Path], list[DHT]],
    scenario: Callable[[list[DHT]], Awaitable[None]],
    seconds: float = SCENARIO_S,
) -> None:
    """Run `scenario` on the DHTs `start` makes (in a directory of their own per attempt); a
    scenario stuck past `seconds` is abandoned, its DHTs killed, and run again on fresh ones,
    up to ATTEMPTS times. The first attempt that ends decides: it passes or raises."""
    for attempt in range(ATTEMPTS):
        folder = directory / f"attempt-{attempt}"
        folder.mkdir(parents=True, exist_ok=True)
        dhts = start(folder)
        stuck = False
        try:
            asyncio.run(asyncio.wait_for(scenario(dhts), seconds))
            return
        except TimeoutError:
            stuck = True
        finally:
            for dht in dhts:
                if stuck:
                    dht.kill()
                    dht.join(10)
                else:
                    dht.shutdown()
    raise AssertionError(f"{ATTEMPTS} scenarios in a row were stuck on a DHT that stopped answering")
