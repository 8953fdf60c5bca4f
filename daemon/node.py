"""One dtnode process, as a composition root: it builds the parts, starts them in order and
stops them in the reverse order. It holds no round logic.

The parts, each one concept:
- `workload/build.py`: the device, model, tokenizer and data the settings name;
- `training/worker.py`: θ_l, θ_g and the outer optimizer on the training thread;
- `checkpoints/store.py`: this node's checkpoints (written, pruned, served, resumed);
- `swarm/credentials.py`: the key that names the node, the swarm key's check, the TLS identity;
- `swarm/bootstrap.py`: the DHT started through --peer and the peers it knew;
- `records/state.py`: the node's state and the one `publish()` of it;
- `rounds/loop.py`: the round loop, with `rounds/pacer.py` (when a round ends), `catchup/joiner.py` (getting
  into step) and `rounds/landing.py` (an overlapped average);
- `records/report.py` and `records/status.py`: the typed round summary and `/status`;
- `serve/sidecar.py`: the HTTP endpoints, which read the node through `NodeView`;
- `listeners.py`: the swarm key and ports checked, the gRPC server and the sidecar started.

Everything runs on one asyncio loop (uvloop). Inner steps run on the worker's training
thread, checkpoint writes on the store's I/O thread, tensor work of the data plane in the
default pool, so the loop stays free to serve peers, heartbeats and HTTP while the model trains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Awaitable
from pathlib import Path

from dtnode import __version__
from dtnode.daemon.catchup.joiner import Joiner
from dtnode.daemon.checkpoints.state_dir import claim_state_dir, startup_error
from dtnode.daemon.checkpoints.store import CheckpointStore
from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.listeners import check_ports, serve_averaging, serve_http, swarm_key
from dtnode.daemon.records.history import FILE_NAME as HISTORY_FILE
from dtnode.daemon.records.history import RoundHistory
from dtnode.daemon.records.report import RunStats
from dtnode.daemon.records.state import Publisher, RoundState
from dtnode.daemon.rounds.landing import Landing
from dtnode.daemon.rounds.loop import RoundLoop
from dtnode.daemon.serve.presenter import Addresses, NodePresenter
from dtnode.daemon.serve.sidecar import ServedSteps
from dtnode.daemon.swarm import hostile
from dtnode.daemon.swarm.bootstrap import (
    DhtBootstrap,
    announce_host,
    dialable_addrs,
    join_command,
    remember_peers,
)
from dtnode.daemon.swarm.credentials import data_plane_trust, node_key, swarm_auth
from dtnode.daemon.swarm.reachability import DialBack, announce_warning, ask_dial_back
from dtnode.daemon.telemetry.metrics import NodeMetrics, watch_feedback, watch_state_dir
from dtnode.daemon.training.ranks.host import plan_ranks
from dtnode.daemon.training.worker import ModelWorker, limit_tensor_threads
from dtnode.daemon.workload.build import build_workload, resolve_device
from dtnode.daemon.workload.recipe import take_recipe_from_peer
from dtnode.daemon.workload.remembered import remember_workload
from dtnode.ops.quantization import use_fused_kernels
from dtnode.peers import failpoints
from dtnode.peers.auth import SwarmAuth
from dtnode.peers.averager import AveragingConfig, MoshpitAverager
from dtnode.peers.channel_pool import ChannelPool
from dtnode.peers.deadlines import AdaptiveDeadlines
from dtnode.peers.dht_in_process import InProcessDHT
from dtnode.peers.dht_start import public_maddrs
from dtnode.peers.hivemind_adapter import RSASignatureValidator
from dtnode.peers.matchmaking import Matchmaker
from dtnode.peers.membership import JoinError, Membership
from dtnode.peers.plan import Member
from dtnode.peers.reduction_registry import ReductionRegistry
from dtnode.peers.tls import TrustStore
from dtnode.peers.wire import max_message_bytes

log = logging.getLogger("dtnode")

FINAL_ANNOUNCE_S = 2.0  # the stopped record, so no group waits for us; it then expires
KERNEL_POLL_S = 0.5  # how often the kernel compiler checks for the first inner step


class Node:
    """The parts of one node, their lifecycle, and the sidecar's view of them."""

    # built by `run`, in this order (the sidecar only serves once all of them exist)
    dht: InProcessDHT
    validator: RSASignatureValidator
    store: CheckpointStore
    membership: Membership
    publisher: Publisher
    presenter: NodePresenter
    rounds: RoundLoop

    def __init__(self, settings: NodeSettings):
        self.settings = settings
        self.device = resolve_device(settings.hardware.device)
        self.state_dir = Path(settings.checkpoints.state_dir)
        self.started_at = time.time()
        self.stopping = asyncio.Event()
        self.stop_flag = threading.Event()  # seen by the training thread
        self.workload = build_workload(settings, self.state_dir)
        self.metrics = NodeMetrics(__version__, settings.swarm.run_id, settings.workload.model, str(self.device))
        watch_state_dir(self.metrics, self.state_dir)
        self.history = RoundHistory(self.state_dir / HISTORY_FILE)
        self.state = RoundState(settings.diloco.overlap)
        self.stats = RunStats()
        self.worker = ModelWorker(settings, self.workload, self.device)
        watch_feedback(self.metrics, lambda: self.worker.feedback_norm)
        self.deadlines = AdaptiveDeadlines(
            settings.averaging.matchmaking_window_min,
            settings.averaging.matchmaking_window,
            settings.averaging.allreduce_timeout_min,
            settings.averaging.allreduce_timeout,
        )
        self.auth: SwarmAuth | None = None
        self.trust: TrustStore | None = None  # the data plane's TLS identities; None with --insecure-data-plane
        self.addr = Addresses()

    # ---- lifecycle ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """SIGINT or SIGTERM: the round in progress is finished or abandoned, then the node stops."""
        if not self.stopping.is_set():
            log.info("stopping: finishing or abandoning the current round")
        self._stop_everything()

    def _stop_everything(self) -> None:
        """Every loop of the node ends at its next check (the training thread's included)."""
        self.stopping.set()
        self.stop_flag.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(self._log_stopped)
            try:
                await self._start(stack)
            except OSError as e:  # a local disk error (a full disk, a read-only state dir): one line
                raise startup_error(e, self.settings) from None
            stack.push_async_callback(self._stop_rounds)
            stack.callback(self._stop_everything)  # however the run ends, the first thing on the way out
            await self.rounds.join()
            if self.settings.wire.fused_kernels and self.settings.wire.compression == "int8":
                # compiling takes seconds of CPU: in the background (eager kernels meanwhile), after
                # the sync, so that a joiner's download does not compete with it; it ends with the
                # first step or the stop flag
                self._kernels = loop.run_in_executor(None, self._compile_kernels)
            await self.rounds.run()
        return 0

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        """Start every part, pushing how to stop it (the stack stops them in reverse order)."""
        s = self.settings
        self.state_dir.mkdir(parents=True, exist_ok=True)
        key = swarm_key(s)
        own = await node_key(self.state_dir)
        self.validator, self.addr.peer_id = own.validator, own.peer_id
        stack.callback(self.worker.shutdown)
        # the model is built while the DHT starts (both take seconds for a joiner)
        building = asyncio.ensure_future(self.worker.call(self.worker.build, self.addr.peer_id))
        bootstrap = DhtBootstrap(s, self.state_dir)
        self.dht, redial = await bootstrap.start(self.addr.peer_id, own.fresh, self.validator)
        stack.push_async_callback(self.dht.shutdown)
        self.addr.peer_id = str(self.dht.peer_id)
        self.addr.dht_addrs = dialable_addrs(self.dht, s.network.announce_host)
        await asyncio.to_thread(bootstrap.remember_dht_port, self.addr.dht_addrs)
        # for `dtnode export`
        await asyncio.to_thread(remember_workload, self.state_dir, s.workload.model, s.workload.tokenizer)
        self.auth = swarm_auth(key, self.addr.peer_id)
        self.trust = await data_plane_trust(
            s.security.insecure_data_plane, self.state_dir, own.record_key, self.addr.peer_id
        )
        await building
        served = ServedSteps()
        await self._open_store(stack, served)
        host = announce_host(s, self.dht)
        registry = ReductionRegistry()
        if not s.network.client_mode:
            grpc_port = await serve_averaging(stack, s, registry, self.auth, self.trust, self.metrics)
            self.addr.grpc_addr = f"{host}:{grpc_port}"
        channels = ChannelPool(max_message_bytes(s.wire.chunk_elements), self.trust)
        stack.push_async_callback(channels.close)
        self._build_round_parts(registry, channels, redial)
        http_port, status_url = await serve_http(stack, s, self.presenter, served, self.auth)
        self.addr.http_addr = f"http://{host}:{http_port}"
        await self.publisher.publish_now()
        self._start_background(stack, bootstrap, channels, host)
        maddr = public_maddrs(self.dht, s.network.announce_host)[0]
        self.addr.join_command = join_command(s, self.workload.recipe, maddr, public=True)  # what /status shows
        _say_up(s, self.addr, status_url or self.addr.http_addr, join_command(s, self.workload.recipe, maddr))

    async def _open_store(self, stack: contextlib.AsyncExitStack, served: ServedSteps) -> None:
        """The checkpoint store, resumed from the state dir, and the round history beside it."""
        s = self.settings
        self.store = CheckpointStore(
            self.state_dir,
            self.worker,
            self.workload.checkpoint_metadata(s),
            s.checkpoints.keep_checkpoints,
            self.metrics,
            served.in_use,
        )
        stack.callback(self.store.shutdown)
        await asyncio.to_thread(self.store.resume, s.swarm.run_id, self.workload.model_hash)
        await asyncio.to_thread(self.history.load)

    def _start_background(
        self, stack: contextlib.AsyncExitStack, bootstrap: DhtBootstrap, channels: ChannelPool, host: str
    ) -> None:
        """What runs beside the rounds: the heartbeat, the peers remembered for a restart, the
        dial-back check of this node's addresses, and a test's attacker when one is armed."""
        s = self.settings
        heartbeat = asyncio.ensure_future(self.membership.heartbeat(self.presenter.record, self.stopping))
        stack.push_async_callback(self._final_announce, heartbeat)
        remembering = asyncio.ensure_future(
            remember_peers(self.membership, bootstrap.known_peers, self.addr.peer_id, self.metrics, self._own_theta)
        )
        stack.push_async_callback(self._stop_remembering, remembering, bootstrap)
        if (warning := announce_warning(s, host)) is not None:
            log.warning("%s", warning)
        if not s.network.client_mode:  # a client is dialled by nobody
            checking = asyncio.ensure_future(self._check_reachable())
            stack.push_async_callback(_cancel, checking)
        if failpoints.armed() is not None:  # a test's attacker acting beside its rounds (daemon/swarm/hostile.py)
            attacking = asyncio.ensure_future(
                hostile.run(
                    self.dht,
                    s.swarm.run_id,
                    s.averaging.target_group_size,
                    self.membership.members,
                    self.presenter.record,
                    channels,
                    s.swarm.heartbeat_interval,
                    self.stopping,
                )
            )
            stack.push_async_callback(_cancel, attacking)

    def _build_round_parts(self, registry: ReductionRegistry, channels: ChannelPool, redial: list[str]) -> None:
        """The parts a round needs, each given the others it uses."""
        s = self.settings
        averager = self._averager(registry, channels, redial)
        self.presenter = NodePresenter(
            s,
            self.addr,
            self.device,
            self.workload,
            self.state,
            self.stats,
            self.worker,
            self.store,
            self.membership,
            self.deadlines,
            self.trust,
            self.metrics,
            self.history,
            self.started_at,
            DialBack(self.addr.peer_id, self.membership.members),
        )
        self.publisher = Publisher(self.state, self.presenter.record, self.membership.announce, self.metrics)
        landing = Landing(self.worker, self.store, self.metrics)
        joiner = Joiner(
            s,
            self.addr.peer_id,
            self.workload.model_hash,
            self.membership,
            self.worker,
            self.store,
            landing,
            self.trust,
            self.auth,
            self.stopping,
            self.state.syncing,
            self.publisher.publish,
        )
        self.rounds = RoundLoop(
            s,
            self.addr.peer_id,
            self.state,
            self.publisher,
            self.worker,
            self.store,
            joiner,
            landing,
            averager,
            self.membership,
            self.stats,
            self.metrics,
            self.history,
            self.workload.sources.loss_floor,
            self.stopping,
            self.stop_flag,
        )

    def _averager(self, registry: ReductionRegistry, channels: ChannelPool, redial: list[str]) -> MoshpitAverager:
        """Membership, matchmaking and the averager over them: the swarm side of a round."""
        s = self.settings
        self.membership = Membership(
            self.dht,
            s.swarm.run_id,
            s.swarm.peer_ttl,
            s.swarm.heartbeat_interval,
            self.validator,
            self.auth,
            initial_peers=redial,
            trust=self.trust,
        )
        matchmaker = Matchmaker(
            self.dht,
            s.swarm.run_id,
            Member(self.addr.peer_id, self.addr.grpc_addr, s.network.client_mode, s.network.bandwidth_mbps),
            auth=self.auth,
            owner=self.validator.local_public_key,
        )
        config = AveragingConfig(
            s.swarm.run_id,
            self.workload.model_hash,
            s.averaging.target_group_size,
            s.averaging.grid_dims,
            s.wire.wire_format(),
            s.wire.chunk_elements,
            s.wire.in_flight_chunks,
            s.averaging.robust_trim(),
            s.wire.feedback_decay,
        )
        averager = MoshpitAverager(
            config,
            self.addr.peer_id,
            self.membership.recent_members,
            matchmaker,
            registry,
            channels,
            self.deadlines,
            self.auth,
            on_phase=self.state.averager_phase,
            on_grid=self.state.use_grid,
        )
        return averager

    async def _stop_rounds(self) -> None:
        """The rounds' share of the way out: the overlapped average still in flight (still a
        member of its groups until it is in), then the final checkpoint."""
        await _quietly(self.rounds.drain(), "applying the last round's average")
        self.state.stop()
        await _quietly(self.store.write_final(), "writing the final checkpoint")

    async def _final_announce(self, heartbeat: asyncio.Future) -> None:
        """Tell peers at once that this node stopped, so no group waits for it."""
        self._stop_everything()  # the heartbeat ends with it (also when the start failed after it began)
        await asyncio.gather(heartbeat, return_exceptions=True)
        with contextlib.suppress(Exception):  # the record expires on its own anyway
            await asyncio.wait_for(self.publisher.publish_now(), FINAL_ANNOUNCE_S)

    async def _check_reachable(self) -> None:
        found = await ask_dial_back(self.addr.peer_id, self.membership.members, self.auth, self.stopping)
        self.presenter.reachability = found
        if found is not None:
            self.metrics.reachable.set(1 if found.ok else 0)

    def _own_theta(self) -> tuple[int, str]:
        """This node's outer step and θ_g hash ("" while it is computed, or before the model is built)."""
        worker = self.worker
        return worker.outer_step, worker.replica.params_sha256() if worker.built else ""

    async def _stop_remembering(self, task: asyncio.Future, bootstrap: DhtBootstrap) -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        try:
            bootstrap.known_peers.save()
        except OSError as e:
            log.warning("could not save the known peers: %s", e)

    def _log_stopped(self) -> None:
        # up to the end of the last round: a node that runs on has no final wait for its last average
        end = self.stats.last_round_end_at
        utilization = self.stats.utilization(end) if end else None
        log.info(
            "stopped at outer step %d%s",
            self.worker.outer_step,
            f"; {utilization:.1%} of the time from the first round's start to the last one's end was spent "
            f"in inner steps"
            if utilization is not None
            else "",
        )

    def _compile_kernels(self) -> None:
        """TorchInductor's int8 kernels, once the first inner step is done (see
        Trainer.first_step_done); eager kernels until then."""
        while not self.stop_flag.is_set():
            if self.worker.trainer.first_step_done.wait(KERNEL_POLL_S):
                use_fused_kernels(True)
                return


def _say_up(s: NodeSettings, addr: Addresses, status_url: str, line: str) -> None:
    """The node is up: where its status is, and the command that adds a peer, `line` with this
    host's paths whole (one JSON log line with --log-format json, else two lines on stdout for
    the person who started it)."""
    up = f"dtnode node {addr.peer_id} is up: status {status_url}/status, gRPC {addr.grpc_addr or 'client mode'}"
    if s.operations.log_format == "json":  # every line a JSON object
        log.info("%s; to add a peer to this swarm: %s", up, line)
    else:
        print(up, flush=True)
        print(f"To add a peer to this swarm, run on another host:\n  {line}", flush=True)


async def _quietly(work: Awaitable[object], what: str) -> None:
    """Await `work` on the way out; a failure is logged, and the rest of the stop goes on."""
    try:
        await work
    except Exception as e:
        log.error("%s failed on the way out (%s: %s)", what, type(e).__name__, e, exc_info=e)


async def _cancel(task: asyncio.Future) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def run_node(settings: NodeSettings) -> int:
    """Run one node on its state dir (held for the run); a local disk error while it starts is
    one SettingsError line, never a traceback."""
    check_ports(settings)
    settings = await take_recipe_from_peer(settings)
    limit_tensor_threads(plan_ranks(settings).threads)
    async with claim_state_dir(Path(settings.checkpoints.state_dir)):
        try:
            node = Node(settings)
        except OSError as e:
            raise startup_error(e, settings) from None
        return await node.run()


__all__ = ["JoinError", "Node", "run_node"]
