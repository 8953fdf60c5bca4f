"""hivemind's DHT node on the node's own event loop, without hivemind's DHT process.

`hivemind.DHT` runs a `DHTNode` in a process of its own, forked from the node, and passes every
call and its answer through a pipe. The fork cost a node 54 MB of pages the child wrote and so
copied (issue 60: an idle `tiny` node held 410 MB of proportional set size with it, 355 MB
without), a second event loop's CPU between rounds, and a class of start failures (a child
forked from a threaded process that never answered). The node already runs one asyncio loop for its gRPC
streams and its HTTP server; the DHT's work (a few requests a second, each a short parse and,
once per entry, a signature check that SwarmValidator remembers) runs on it as tasks. p2pd,
hivemind's libp2p daemon, is still a child process of the node.

`InProcessDHT` keeps the part of `hivemind.DHT`'s interface the node uses (`get`, `store`,
`run_coroutine`, `peer_id`, `get_visible_maddrs`), with the same arguments, so the peers layer
takes either; `return_future` is accepted and ignored: every call returns an awaitable.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .dht_unanswered import count_unanswered
from .hivemind_adapter import DHT, P2P, CompositeValidator, DHTNode, Multiaddr, PeerID, RecordValidatorBase

log = logging.getLogger(__name__)
T = TypeVar("T")
SHUTDOWN_S = 5.0  # for the DHT node to close its requests, then again for p2pd to exit
# the P2P objects `P2P.create` made in this task, so that a start that failed can stop them
_CREATED: contextvars.ContextVar[list[P2P] | None] = contextvars.ContextVar("dtnode_p2p_created", default=None)


class _OwnedP2P(P2P):
    """hivemind's P2P that its creator can stop even when `P2P.create` raised.

    `P2P.create` starts p2pd and then fails on its way out in several places (the daemon's
    bootstrap, the control client, the first ping) without returning the object: a daemon that
    failed after it printed its peer id keeps running with nobody to stop it, and one that failed
    its bootstrap is still exiting when the error arrives (CI saw it running after the JoinError).
    The object records itself where `InProcessDHT.create` looks for it."""

    def __init__(self) -> None:
        super().__init__()
        created = _CREATED.get()
        if created is not None:
            created.append(self)


class InProcessDHT:
    """A running DHT node on this loop, and the p2pd daemon it owns."""

    def __init__(self, node: DHTNode, p2p: P2P, maddrs: list[Multiaddr]):
        self.node = node
        self.p2p = p2p
        self._maddrs = maddrs

    @classmethod
    async def create(
        cls,
        *,
        initial_peers: Sequence[str],
        host_maddrs: Sequence[str],
        announce_maddrs: Sequence[str] | None,
        record_validators: Sequence[RecordValidatorBase],
        num_replicas: int,
        client_mode: bool,
        identity_path: str | None,
        check_if_identity_free: bool,
        startup_timeout: float,
    ) -> InProcessDHT:
        """p2pd started, then the DHT node on it bootstrapped through `initial_peers`, both within
        `startup_timeout` (TimeoutError past it). Whatever fails, a p2pd started here is stopped:
        a caller that tries again does not leave daemons behind."""
        p2p_options: dict[str, Any] = {"initial_peers": list(initial_peers), "host_maddrs": list(host_maddrs)}
        if announce_maddrs:
            p2p_options["announce_maddrs"] = list(announce_maddrs)
        if identity_path is not None:
            p2p_options["identity_path"] = identity_path
            p2p_options["check_if_identity_free"] = check_if_identity_free
        if client_mode:
            p2p_options["dht_mode"] = "client"  # as DHTNode.create sets it for a p2pd of its own
        loop = asyncio.get_running_loop()
        deadline = loop.time() + startup_timeout
        created: list[P2P] = []
        token = _CREATED.set(created)
        try:
            p2p = await _OwnedP2P.create(startup_timeout=startup_timeout, **p2p_options)
        except BaseException:
            for unfinished in created:  # its p2pd stopped and waited for, not left exiting
                await _stop_daemon(unfinished)
            raise
        finally:
            _CREATED.reset(token)
        try:
            node = await asyncio.wait_for(
                DHTNode.create(
                    p2p=p2p,
                    initial_peers=list(initial_peers),
                    num_replicas=num_replicas,
                    client_mode=client_mode,
                    record_validator=CompositeValidator(list(record_validators)),
                ),
                max(deadline - loop.time(), 1.0),
            )
            maddrs = await p2p.get_visible_maddrs()
            count_unanswered(node.protocol)  # dtnode_dht_unanswered_total
        except BaseException:
            await _stop_daemon(p2p)
            raise
        return cls(node, p2p, maddrs)

    @property
    def peer_id(self) -> PeerID:
        return self.node.peer_id

    def get_visible_maddrs(self, latest: bool = False) -> list[Multiaddr]:
        """The multiaddrs p2pd listens on, as it said at the start (a node binds them once)."""
        return list(self._maddrs)

    async def get(self, key: Any, latest: bool = False, return_future: bool = True, **kwargs: Any) -> Any:
        """`DHTNode.get`: the key's value with its expiration, or None."""
        return await self.node.get(key, latest=latest, **kwargs)

    async def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        return_future: bool = True,
        **kwargs: Any,
    ) -> Any:
        """`DHTNode.store`: whether the value was stored on at least one replica."""
        return await self.node.store(key, value, expiration_time, subkey=subkey, **kwargs)

    async def run_coroutine(self, coroutine: Callable[[Any, DHTNode], Awaitable[T]], return_future: bool = True) -> T:
        """`coroutine(self, node)`, as hivemind's DHT runs one in its process."""
        return await coroutine(self, self.node)

    async def shutdown(self) -> None:
        """Close the DHT node's requests, then stop p2pd, each within SHUTDOWN_S."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.node.shutdown(), SHUTDOWN_S)
        await _stop_daemon(self.p2p)


async def _stop_daemon(p2p: P2P) -> None:
    """p2pd asked to stop and waited for; killed if it has not exited within SHUTDOWN_S."""
    try:
        await asyncio.wait_for(p2p.shutdown(), SHUTDOWN_S)
    except TimeoutError:
        child = getattr(p2p, "_child", None)
        if child is not None and child.returncode is None:
            log.warning("p2pd did not stop within %.0fs; killed", SHUTDOWN_S)
            with contextlib.suppress(ProcessLookupError):
                child.kill()
    except Exception as e:  # noqa: BLE001  (a daemon already gone is stopped)
        log.debug("stopping p2pd: %s", e)


# what the peers layer takes: the node's DHT, or hivemind's process (tests start those)
SwarmDHT = InProcessDHT | DHT

__all__ = ["InProcessDHT", "SwarmDHT"]
