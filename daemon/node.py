"""One dtnode process: DHT membership, the DiLoCo round loop, gRPC averaging, HTTP sidecar.

Everything runs on one asyncio loop (uvloop). Inner steps run on a dedicated training
thread, checkpoint writes on another, tensor work of the data plane in the default pool,
so the loop stays free to serve peers, heartbeats and HTTP while the model trains.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import math
import re
import signal
import socket
import threading
import time
from collections.abc import Awaitable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dtnode import __version__
from dtnode.peers import failpoints  # first of the hivemind users: see dtnode.peers on what it imports
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from dtnode.ops.flat import sha256_of
from dtnode.ops.quantization import fused_kernels_active, use_fused_kernels
from dtnode.peers.averager import AveragingConfig, AveragingResult, HopReport, MoshpitAverager
from dtnode.peers.butterfly import ChannelPool
from dtnode.peers.deadlines import AdaptiveDeadlines, expected_payload_bytes
from dtnode.peers.pacing import SwarmProgress, swarm_progress
from dtnode.peers.plan import Member
from dtnode.peers.reducer import AveragingService, ReductionRegistry
from dtnode.peers.wire import max_message_bytes
from dtnode.peers.matchmaking import Matchmaker
from dtnode.peers.auth import ENV_KEY, AuthError, SwarmAuth, load_swarm_key
from dtnode.peers.membership import JoinError, Membership, PeerRecord, load_record_key, public_maddrs, start_dht
from dtnode.peers.known_peers import FILE_NAME as KNOWN_PEERS_FILE, KnownPeers, own_peer_id, peer_of
from dtnode.peers.sidecar_address import SidecarAddressError, is_sidecar_address, resolve_peers
from dtnode.peers.tls import NodeIdentity, TrustStore, encode_certificate
from dtnode.peers.server import GrpcPortError, port_in_use, start_grpc_server

from .checkpoint import (
    CheckpointError, CheckpointInfo, Layout, LoadedCheckpoint, LocalState, MemoryCheckpoint, TrainingState, file_sha256,
    ABANDONED_DIR, list_checkpoints, prune_checkpoints, read_checkpoint, read_local_state,
    set_aside_checkpoints_after, write_checkpoint,
)
from .corpus import TokenCorpus
from .data import DataStream, check_token_ids, open_sources, stable_seed
from .export import remember_workload
from .hf_model import HFModelError
from .schedule import LearningRateSchedule
from .history import FILE_NAME as HISTORY_FILE, RoundHistory
from .metrics import NodeMetrics, failure_reason
from .model import HF_PREFIX, build_model, config_hash, export_format
from .replica import Replica
from .settings import NodeSettings, SettingsError
from .sidecar import Sidecar
from .sync import SwarmPosition, fetch_from_swarm, swarm_position
from .tokenizer import check_vocabulary, load_tokenizer
from .trainer import InnerResult, Trainer

if TYPE_CHECKING:
    from hivemind.utils.crypto import RSAPrivateKey

log = logging.getLogger("dtnode")

PACER_POLL_S = 0.2  # how often a training node re-reads the swarm's progress
MAX_ROUND_FACTOR = 100  # a paced round takes at most this many times H steps on one peer
TOKEN_CACHE_DIR = "data-cache"  # token files made from text data (corpus.py), reused across restarts
TLS_CERT_FILE = "tls.crt"  # this node's data-plane certificate (PEM), derived from its record key
DHT_PORT_FILE = "dht-port"  # the DHT port of the last run, reused when free (--dht-port 0)
REMEMBER_PEERS_EVERY_S = 5.0
MAX_PEERS_SEEN = 1 << 16
REDIAL_KNOWN_PEERS = 8  # known peers an isolated node redials each heartbeat (besides --peer)
MAX_SYNC_DOWNLOADS = 3  # downloads in a row while the swarm's round keeps closing under a joiner


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SettingsError("--device", "CUDA is not available on this host")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SettingsError("--device", f"no CUDA device {device.index} (found {torch.cuda.device_count()})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise SettingsError("--device", "MPS is not available on this host")
    return device


MAX_REENTRIES = 3  # a joiner's first rounds given up in a row because the swarm averaged them without it


class Node:
    def __init__(self, settings: NodeSettings):
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.state = "joining"
        self.started_at = time.time()
        self.stop_requested = asyncio.Event()
        self.stop_flag = threading.Event()  # seen by the training thread
        self.state_dir = Path(settings.state_dir)
        self.checkpoints: dict[int, CheckpointInfo] = {}
        self.last_round: dict[str, Any] = {}
        self.rounds_done = 0
        self.inner_seconds = 0.0  # wall time in inner steps since the first round began
        self._waited_s = 0.0  # --overlap: this round's wait for the previous round's average
        self.first_round_at: float | None = None  # monotonic
        self.last_round_end_at: float | None = None  # monotonic
        self.tokens_per_s = 0.0  # of the last round
        self.rate_estimate = 0.0  # what the record announces before this round's own rate is known
        self.eval_loss: float | None = None
        self.eval_step: int | None = None  # the outer step whose θ_g eval_loss is of (--eval-every)
        self.train_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train")
        self.io_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pending_write: asyncio.Future | None = None
        self._hash_task: asyncio.Future | None = None
        self._in_flight: asyncio.Future | None = None  # --overlap: the average of the last round's Δ
        # --overlap: that average once it is in (set on the event loop), and whether its outer step
        # was made (by the training thread: between inner steps, or at the round's end)
        self._arrival: AveragingResult | None = None
        self._landed = True
        self._landed_after_steps: int | None = None  # inner steps of this round before it landed
        self._resync_asked = False  # whether the average in flight was asked to re-sync θ_g
        self._training_round = 0  # --overlap: the round whose inner steps run (one past the outer step)
        self._catch_up_round: int | None = None  # --overlap: a round entered from a download (see _catch_up)
        self._entered_round: int | None = None  # the round entered from a download (its first after it)
        self._reentries = 0  # rounds given up in a row for that reason (bounded: see _closed_before_joined)
        self.theta_lock = threading.Lock()  # θ_g and momentum change (training thread) or are copied (I/O)
        self._theta_version = 0  # bumped at each change of θ_g or the momentum
        self._memory: dict[int, MemoryCheckpoint] = {}  # steps served from memory (see current_checkpoint)
        self._round_end_at = math.inf  # monotonic time the pacer expects the swarm's round to end
        self.round_progress: SwarmProgress | None = None
        self.round_failures = 0
        self.deadlines = AdaptiveDeadlines(settings.matchmaking_window_min, settings.matchmaking_window,
                                           settings.allreduce_timeout_min, settings.allreduce_timeout)
        self.residual: torch.Tensor | None = None  # error feedback, when enabled
        self.auth: SwarmAuth | None = None
        self.trust: TrustStore | None = None  # the data plane's TLS identities; None with --insecure-data-plane
        self._needs_resync = False  # set by a failed hop or a download; cleared by a clean round
        self.phase = "starting"  # inner, matchmaking, allreduce, outer: where the round is (chaos tests key on it)
        # What the record tells a joiner (daemon/sync.py): the round in progress, its phase in
        # a joiner's terms (inner: still open; averaging, outer: closed), the θ_g step it starts from
        self.round_no = -1
        self.round_phase = ""
        self.round_start_step = -1
        self._first_group_formed = False  # while not, a round being averaged still takes members (hop 0)
        self.dht_addrs: tuple[str, ...] = ()
        self.joined_at: float | None = None  # monotonic: when a download put this node in step (for the log)
        self.peer_id = ""
        self.grpc_addr = ""
        self.http_addr = ""
        self.join_command = ""
        self.history = RoundHistory(self.state_dir / HISTORY_FILE)
        self._recent_outcomes: collections.deque[str] = collections.deque(maxlen=5)
        self._peers_seen: set[str] = set()  # ids, for the metric (bounded by the swarm's size)
        self._build_workload()
        self._build_metrics()

    # ---- set-up -------------------------------------------------------------------------
    def _build_workload(self) -> None:
        s = self.settings
        seed = stable_seed(s.run_id, s.seed, "init")
        try:
            model, self.model_description = build_model(s.model, seed)
        except HFModelError as e:
            raise SettingsError("--model", str(e)) from None
        except (ImportError, AttributeError, TypeError) as e:  # a module:factory that cannot serve
            raise SettingsError("--model", f"cannot build {s.model}: {e}") from None
        tokenizer = load_tokenizer(s.tokenizer)
        check_vocabulary(tokenizer, model.vocab_size)
        if s.tokenizer is not None:  # peers that split text differently must not average
            self.model_description["tokenizer"] = tokenizer.sha256
        self.model_hash = config_hash(self.model_description)
        self.seq_len = min(s.seq_len or model.context_length, model.context_length)
        self.sources = open_sources(s.run_id, s.seed, s.data, s.eval_data, s.eval_fraction, self.seq_len,
                                    tokenizer=tokenizer, text_field=s.text_field, data_dtype=s.data_dtype,
                                    cache_dir=self.state_dir / TOKEN_CACHE_DIR)
        for source, option in ((self.sources.train, "--data"),
                               (self.sources.eval, "--eval-data" if s.eval_data else "--data")):
            if isinstance(source, TokenCorpus):
                check_token_ids(source, model.vocab_size, option)
        self.init_seed = seed
        self.export_format = export_format(self.model_description)
        self._model = model

    def _build_metrics(self) -> None:
        s = self.settings
        self.metrics = NodeMetrics(__version__, s.run_id, s.model, str(self.device))
        self.metrics_registry = self.metrics.registry

    def _start_training_state(self) -> None:
        s = self.settings
        stream = DataStream(self.sources, s.run_id, self.peer_id, s.batch_size, self.seq_len, s.eval_sequences)
        schedule = LearningRateSchedule(s.inner_lr, s.warmup_steps, s.total_steps, s.lr_schedule, s.min_lr_ratio)
        self.trainer = Trainer(self._model, stream, self.device, schedule=schedule,
                               weight_decay=s.inner_weight_decay, grad_clip=s.grad_clip, compile=s.compile)
        self.replica = Replica(self.trainer, s.outer_lr, s.outer_momentum)
        flat = self.trainer.flat
        self.layout = Layout(tuple(flat.names), tuple(flat.shapes))
        if s.error_feedback and s.compression == "int8":
            self.residual = torch.zeros(self.replica.numel, dtype=torch.float32)

    def _resume_local(self) -> None:
        """Resume from the newest whole checkpoint in the state dir; skip torn ones."""
        for step, path in list_checkpoints(self.state_dir):
            try:
                loaded = read_checkpoint(path, self.layout, self.settings.run_id, self.model_hash)
            except CheckpointError as e:
                log.warning("skipping checkpoint %s: %s", path.name, e)
                continue
            try:
                local = read_local_state(self.state_dir, step, self.layout, self.settings.run_id, self.model_hash)
            except CheckpointError as e:
                log.warning("no usable inner state for step %d (%s): inner optimizer starts fresh", step, e)
                local = None
            self._install(loaded, local)
            self.replica.set_params_sha256(sha256_of(self.replica.host_theta()))
            self.checkpoints[step] = CheckpointInfo(step, path, file_sha256(path), path.stat().st_size)
            log.info("resumed from %s (outer step %d, params %s)", path.name, step, self.replica.params_sha256()[:12])
            return

    def _install(self, loaded: LoadedCheckpoint, local: LocalState | None = None, keep_inner: bool = False) -> None:
        """Load a checkpoint into the replica (on the training thread), with this node's own
        inner state and data position when resuming; a donor's checkpoint brings θ_g and the
        outer momentum only, and the inner AdamW starts fresh (with its warmup)."""
        with self._theta_changing():
            self.replica.load(loaded.theta_g, loaded.momentum, loaded.step)
        if keep_inner:
            return
        if local is None:
            self.trainer.load_inner_state(torch.empty(0), torch.empty(0), 0)
            self.trainer.inner_step = 0
            return
        self.trainer.load_inner_state(local.exp_avg, local.exp_avg_sq, local.adam_steps)
        self.trainer.inner_step = local.inner_step
        try:
            self.trainer.stream.seek(local.generator_state, local.batches_drawn)
        except (RuntimeError, ValueError) as e:  # a generator state from another torch build
            log.warning("could not restore the data position (%s); continuing from a fresh one", e)

    def _announce_host(self) -> str:
        s = self.settings
        if s.announce_host:
            return s.announce_host
        if s.host not in ("0.0.0.0", "::", ""):
            return s.host
        for addr in public_maddrs(self.dht, None):
            parts = addr.split("/")
            if len(parts) > 2 and parts[1] == "ip4" and not parts[2].startswith("127.") and parts[2] != "0.0.0.0":
                return parts[2]
        return socket.gethostbyname("localhost")

    # ---- what the sidecar shows ------------------------------------------------------------
    def record(self) -> PeerRecord:
        newest = self.checkpoint()
        return PeerRecord(
            peer_id=self.peer_id, grpc_addr=self.grpc_addr, http_addr=self.http_addr, state=self.state,
            outer_step=self.replica.outer_step, checkpoint_step=newest.step if newest else -1,
            checkpoint_sha256=newest.sha256 if newest else "", tokens_per_s=self._live_rate(),
            round_tokens=self.trainer.round_tokens if hasattr(self, "trainer") else 0,
            training_round=self._training_round if self.settings.overlap else -1,
            round=self.round_no if self.round_phase else -1, phase=self._record_phase(),
            round_checkpoint=self.round_start_step if self.round_phase else -1, dht_addrs=self.dht_addrs,
            tokens_per_step=self.trainer.tokens_per_step if hasattr(self, "trainer") else 0,
            progress_at=get_dht_time(), bandwidth_mbps=self.settings.bandwidth_mbps, device=str(self.device), client_mode=self.settings.client_mode,
            model_hash=self.model_hash, version=__version__,
            tls_cert=encode_certificate(self.trust.own.cert_der) if self.trust is not None else "",
        )

    def _tls_identity(self, record_key: RSAPrivateKey) -> TrustStore:
        """This node's TLS certificate, self-signed with its record key, kept in the state dir
        (operators can compare its fingerprint with the one peers log)."""
        identity = NodeIdentity.from_key(record_key._private_key, self.peer_id)
        path = self.state_dir / TLS_CERT_FILE
        if not path.exists() or path.read_bytes() != identity.cert_pem:
            path.write_bytes(identity.cert_pem)
        return TrustStore(identity, self.peer_id)

    def _record_phase(self) -> str:
        """The round's phase in a joiner's terms: `inner` and `matchmaking` (hop 0 still forming:
        its groups wait for a peer that trains this round) are open, `averaging` and `outer` closed."""
        if self.round_phase == "averaging" and not self._first_group_formed and not self.settings.overlap:
            return "matchmaking"
        return self.round_phase

    def _live_rate(self) -> float:
        """Tokens per second this round so far, once two steps are in; before that a cautious
        estimate from earlier rounds. Every peer predicts the round's end from the swarm's
        summed rate: an over-estimate would have them all expect it too soon."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.round_tokens >= 2 * trainer.tokens_per_step and trainer.round_seconds > 0:
            return trainer.round_tokens / trainer.round_seconds
        return self.rate_estimate

    def status(self) -> dict[str, Any]:
        loss = self.trainer.last_loss if hasattr(self, "trainer") else math.nan
        return {
            "peer_id": self.peer_id, "run_id": self.settings.run_id, "state": self.state, "phase": self.phase,
            "outer_step": self.replica.outer_step if hasattr(self, "replica") else 0,
            "inner_step": self.trainer.inner_step if hasattr(self, "trainer") else 0,
            "inner_lr": self.trainer.lr if hasattr(self, "trainer") else None,
            "loss": None if math.isnan(loss) else loss, "eval_loss": self.eval_loss, "eval_step": self.eval_step,
            "loss_floor": self.sources.loss_floor, "tokens_per_s": self.tokens_per_s,
            "compute_utilization": self.compute_utilization(),
            "uptime_s": time.time() - self.started_at,
            "params_sha256": self.replica.params_sha256() if hasattr(self, "replica") else "",
            "http_url": self.http_addr, "grpc_addr": self.grpc_addr, "join_command": self.join_command,
            "dht_addrs": list(self.dht_addrs),
            "tls_fingerprint": self.trust.own.fingerprint if self.trust is not None else None,
            "model": self.settings.model, "model_hash": self.model_hash, "device": str(self.device),
            "client_mode": self.settings.client_mode, "version": __version__, "last_round": self.last_round,
            "deadlines": self.deadlines.snapshot(self._expected_bytes()), "fused_kernels": fused_kernels_active(),
            "pacing": self.settings.pacing, "round_failures": self.round_failures, **self._condition(),
            "round_progress": None if self.round_progress is None else {
                "target_tokens": self.round_progress.target, "swarm_tokens": round(self.round_progress.done),
                "peers": self.round_progress.peers, "own_tokens": self.trainer.round_tokens},
        }

    def _condition(self) -> dict[str, str]:
        """One word for the dashboard's banner and `dtnode status`, and a line saying why."""
        recent = list(self._recent_outcomes)
        if self.state in ("joining", "syncing"):
            return {"condition": "catching up", "condition_detail": "downloading the swarm's state"}
        if recent and (recent[-1] == "failed" or sum(o in ("failed", "partial") for o in recent) >= 3):
            bad = sum(o in ("failed", "partial") for o in recent)
            return {"condition": "failing", "condition_detail": f"{bad} of the last {len(recent)} rounds failed or "
                                                                "were partial; see the node's log"}
        if recent and recent[-1] == "alone":
            return {"condition": "alone", "condition_detail": "no other peer averaged with this node last round"}
        if not recent:
            return {"condition": "starting", "condition_detail": "no round finished yet"}
        return {"condition": "ok", "condition_detail": f"last round {recent[-1]}"}

    def _expected_bytes(self) -> int:
        if not hasattr(self, "replica"):
            return 0
        size = max(self.last_round.get("group_size", 2), 2)
        return expected_payload_bytes(self.replica.numel, size, self.settings.compression == "int8",
                                      self.settings.quant_block_size)

    async def peer_records(self) -> list[dict[str, Any]]:
        """The swarm's records, with what a reader wants from them: seconds since each was
        last refreshed, and how many outer steps each is behind this node."""
        members = await self.membership.members()
        now, own = get_dht_time(), self.replica.outer_step if hasattr(self, "replica") else 0
        return [r.model_dump() | {"last_seen_s": round(max(0.0, now - r.progress_at), 1), "lag": own - r.outer_step}
                for r in sorted(members.values(), key=lambda r: r.peer_id)]

    def checkpoint(self, step: int | None = None) -> CheckpointInfo | None:
        if step is None:
            return self.checkpoints[max(self.checkpoints)] if self.checkpoints else None
        return self.checkpoints.get(step)

    # ---- lifecycle ------------------------------------------------------------------------
    def request_stop(self) -> None:
        if not self.stop_requested.is_set():
            log.info("stopping: finishing or abandoning the current round")
        self.stop_requested.set()
        self.stop_flag.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        s = self.settings
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            key = load_swarm_key(str(s.swarm_key_file) if s.swarm_key_file else None,
                                 {ENV_KEY: s.swarm_key.get_secret_value()} if s.swarm_key else {})
        except AuthError as e:
            raise SettingsError("--swarm-key-file", str(e)) from None
        record_key = await asyncio.to_thread(load_record_key, self.state_dir / "record.key")
        validator = RSASignatureValidator(record_key)
        identity = (self.state_dir / "identity.key").resolve()
        self._fresh_identity = not identity.exists()
        if self._fresh_identity:  # made here rather than by hivemind: the peer id is known before the DHT runs
            await asyncio.to_thread(P2P.generate_identity, str(identity))
        self.peer_id = await asyncio.to_thread(own_peer_id, identity) or ""
        # the model's training state is built while the DHT starts (both take seconds for a joiner)
        training_state = loop.run_in_executor(self.train_thread, self._start_training_state)
        try:
            self.dht, self.bootstrap = await self._start_dht(validator)
        except BaseException:
            await asyncio.gather(training_state, return_exceptions=True)
            raise
        self.validator = validator
        self.peer_id = str(self.dht.peer_id)
        self.dht_addrs = tuple(a for a in public_maddrs(self.dht, s.announce_host)
                               if "/0.0.0.0/" not in a and "/::/" not in a)[:4]
        await asyncio.to_thread(self._remember_dht_port)
        await asyncio.to_thread(remember_workload, self.state_dir, s.model, s.tokenizer)  # for `dtnode export`
        if key is None:
            log.warning("no swarm key (--swarm-key-file or DTNODE_SWARM_KEY): this swarm is open, anyone who can "
                        "reach it may join its groups and download its checkpoints")
        else:
            self.auth = SwarmAuth(key, self.peer_id)
        if s.insecure_data_plane:
            self.trust = None
            log.warning("--insecure-data-plane: pseudo-gradients travel in plaintext; anyone on the path can read "
                        "or alter them, and a swarm key holder can speak as another peer")
        else:
            self.trust = await asyncio.to_thread(self._tls_identity, record_key)
        self.heartbeat_task: asyncio.Task | None = None
        self.remember_task: asyncio.Task | None = None
        self.grpc_server = None
        self.sidecar = Sidecar(self)
        self.channels = ChannelPool(max_message_bytes(s.chunk_elements), self.trust)
        try:
            await training_state
            await loop.run_in_executor(self.io_thread, self._resume_local)
            await loop.run_in_executor(self.io_thread, self.history.load)
            await self._start_services()
            self.state = "syncing"
            await self._sync_with_swarm(joining=True)
            self.state = "training"
            if s.fused_kernels and s.compression == "int8":
                # Compiling takes seconds of CPU: in the background, eager kernels meanwhile; after
                # the sync, so that a joiner's download does not compete with it (the first average
                # is a round away)
                self._kernels_task = loop.run_in_executor(None, self._compile_kernels)
            await self.membership.announce(self.record())
            if s.min_peers > 1:
                log.info("waiting for %d peers (up to %.0fs)", s.min_peers, s.join_timeout)
                view = await self._wait_or_stop(self.membership.wait_for(s.min_peers, s.join_timeout))
                if view is not None and len(view) < s.min_peers:
                    log.warning("only %d of %d peers after %.0fs; training anyway", len(view), s.min_peers,
                                s.join_timeout)
            while not self.stop_requested.is_set():
                if s.max_rounds is not None and self.rounds_done >= s.max_rounds:
                    log.info("finished %d rounds (--max-rounds)", self.rounds_done)
                    break
                await self._guarded_round()
            return 0
        finally:
            await self._shutdown()

    async def _start_dht(self, validator: RSASignatureValidator) -> tuple[Any, list[str]]:
        """Join the DHT through --peer and the peers this node knew (state dir), never itself.

        A restarted node whose --peer is down, or is its own old address (the swarm's first
        node), still finds the swarm through any peer it saw before. The first node of a
        swarm (no --peer other than itself) whose known peers are all gone starts alone and
        keeps dialling them; a node given --peer that reaches nobody ends with the list it tried."""
        s = self.settings
        identity = (self.state_dir / "identity.key").resolve()
        own = self.peer_id or None
        self.known_peers = await asyncio.to_thread(KnownPeers(self.state_dir / KNOWN_PEERS_FILE).load)
        given = await self._resolve_sidecar_peers()
        named = [a for a in given if own is None or peer_of(a) != own]
        if len(named) < len(given):
            log.info("--peer %s is this node's own address: joining through the peers it knew instead",
                     next(a for a in given if a not in named))
        known = [a for a in self.known_peers.addresses(exclude=own) if a not in named]
        port = s.dht_port or await asyncio.to_thread(self._previous_dht_port)
        start = partial(start_dht, host=s.host, port=port, announce_host=s.announce_host, timeout=s.join_timeout,
                        identity_path=str(identity), validator=validator, fresh_identity=self._fresh_identity)
        try:
            return await start(named + known), named + self._redial(own)
        except JoinError as e:
            if not known:
                raise
            tried = (f"{len({peer_of(a) for a in known})} peer(s) it knew ({', '.join(known[:3])}"
                     f"{', ...' if len(known) > 3 else ''})")
            if named:
                raise JoinError(f"could not join through --peer {', '.join(named)} nor the {tried}: {e}") from None
            log.warning("none of the %s answered (%s); starting alone and dialling them until they do", tried, e)
            return await start([]), self._redial(own)

    async def _resolve_sidecar_peers(self) -> list[str]:
        """--peer with each sidecar address (http://HOST:PORT) replaced by that node's multiaddrs.
        A node that knew peers before goes on without a sidecar that does not answer."""
        s = self.settings
        if not any(is_sidecar_address(p) for p in s.peers):
            return list(s.peers)
        knows_peers = bool(self.known_peers.addresses(exclude=self.peer_id or None))
        try:
            resolved = await resolve_peers(s.peers, min(s.join_timeout, 10.0) if knows_peers else s.join_timeout)
        except SidecarAddressError as e:
            if not knows_peers:
                raise JoinError(f"could not join through --peer: {e}") from None
            log.warning("%s; joining through the peers this node knew", e)
            return [p for p in s.peers if not is_sidecar_address(p)]
        log.info("--peer %s: %s", ", ".join(p for p in s.peers if is_sidecar_address(p)),
                 ", ".join(a for a in resolved if a not in s.peers))
        return resolved

    def _redial(self, own: str | None) -> list[str]:
        """What an isolated node dials on each heartbeat besides --peer (one at a time, so few):
        the first address of each of the peers it knew most recently."""
        firsts = [addrs[0] for peer, (addrs, _) in sorted(self.known_peers.peers.items(), key=lambda i: -i[1][1])
                  if peer != own]
        return [a for a in firsts if a not in self.settings.peers][:REDIAL_KNOWN_PEERS]

    def _previous_dht_port(self) -> int:
        """The DHT port of this state dir's last run, if it is free: a restarted node keeps the
        address its peers (and their --peer flags) know. 0 (any) otherwise."""
        try:
            port = int((self.state_dir / DHT_PORT_FILE).read_text().strip())
        except (OSError, ValueError):
            return 0
        if not 0 < port < 65536:
            return 0
        with socket.socket(socket.AF_INET6 if ":" in self.settings.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.settings.host, port))
            except OSError:
                return 0
        return port

    def _remember_dht_port(self) -> None:
        ports = [m.group(1) for addr in self.dht_addrs if (m := re.search(r"/tcp/(\d+)", addr))]
        if ports:
            (self.state_dir / DHT_PORT_FILE).write_text(ports[0])

    async def _remember_peers(self) -> None:
        """Keep the addresses of the peers seen, for the next start (every few heartbeats, and at stop)."""
        while True:
            try:
                view = await self.membership.members()
                if len(self._peers_seen) > MAX_PEERS_SEEN:  # an open swarm's churn: start counting again
                    self._peers_seen.clear()
                self._peers_seen.update(view)
                self.metrics.peers_live.set(len(view | {self.peer_id: None}))
                self.metrics.peers_seen.set(len(self._peers_seen | {self.peer_id}))
                self.known_peers.remember(view.values(), self.peer_id)
                await asyncio.to_thread(self.known_peers.save)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a full disk must not stop training; the next pass retries
                log.warning("could not save the known peers: %s", e)
            await asyncio.sleep(REMEMBER_PEERS_EVERY_S)

    async def _wait_or_stop(self, coro):
        task = asyncio.ensure_future(coro)
        stopper = asyncio.ensure_future(self.stop_requested.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not task.done():
            task.cancel()
            return None
        return task.result()

    async def _start_services(self) -> None:
        s = self.settings
        announce = self._announce_host()
        self.registry = ReductionRegistry()
        if not s.client_mode:
            service = AveragingService(self.registry, s.run_id, registration_wait=min(5.0, s.matchmaking_window),
                                       auth=self.auth, trust=self.trust)
            credentials = self.trust.server_credentials() if self.trust is not None else None
            try:
                self.grpc_server, grpc_port = await start_grpc_server(service, s.host, s.grpc_port,
                                                                      max_message_bytes(s.chunk_elements),
                                                                      credentials=credentials)
            except GrpcPortError as e:  # taken since the check at start
                raise SettingsError("--grpc-port", str(e)) from None
            self.grpc_addr = f"{announce}:{grpc_port}"
        self.sidecar.auth = self.auth
        try:
            http_port = await self.sidecar.start(s.host, s.http_port)
        except OSError as e:
            raise SettingsError("--http-port", f"cannot listen on {s.host}:{s.http_port}: {e.strerror or e}") from None
        self.http_addr = f"http://{announce}:{http_port}"
        self.membership = Membership(self.dht, s.run_id, s.peer_ttl, s.heartbeat_interval, self.validator, self.auth,
                                     initial_peers=self.bootstrap, trust=self.trust)
        self.matchmaker = Matchmaker(self.dht, s.run_id, Member(self.peer_id, self.grpc_addr, s.client_mode,
                                                                 s.bandwidth_mbps), auth=self.auth)
        config = AveragingConfig(s.run_id, self.model_hash, s.target_group_size, s.grid_dims, s.compression == "int8",
                                 s.quant_block_size, s.chunk_elements, s.in_flight_chunks,
                                 s.trim_fraction if s.aggregation == "trimmed-mean" else None)
        self.averager = MoshpitAverager(config, self.peer_id, self.membership.members, self.matchmaker, self.registry,
                                        self.channels, self.deadlines, self.auth, on_phase=self._set_phase)
        await self.membership.announce(self.record())
        self.heartbeat_task = asyncio.create_task(self.membership.heartbeat(self.record, self.stop_requested))
        self.remember_task = asyncio.create_task(self._remember_peers())
        maddr = public_maddrs(self.dht, s.announce_host)[0]
        extra = f" --run-id {s.run_id}" if s.run_id != "dtnode-demo" else ""
        extra += f" --model {s.model}" if s.model != "tiny" else ""
        extra += f" --tokenizer {s.tokenizer}" if s.tokenizer is not None else ""  # every peer needs the same
        self.join_command = f"dtnode join --peer {maddr}{extra}"
        up = f"dtnode node {self.peer_id} is up: status {self.http_addr}/status, gRPC {self.grpc_addr or 'client mode'}"
        if s.log_format == "json":  # every line a JSON object
            log.info("%s; to add a peer to this swarm: %s", up, self.join_command)
        else:
            print(up, flush=True)
            print(f"To add a peer to this swarm, run on another host:\n  {self.join_command}", flush=True)

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        if phase == "allreduce":  # a group formed: the round is closed to newcomers
            self._first_group_formed = True

    async def _sync_with_swarm(self, joining: bool = False) -> bool:
        """Put this node in the round the swarm is in, downloading the θ_g that round starts
        from when this node's differs: it is behind the swarm's open round (by more than
        --max-lag, or at all when `joining`: a node that just started), or ahead of it by more
        than a round plus --max-lag (solo rounds while cut off: a branch the swarm never saw).

        The open round comes from the peers' records (`swarm_position`): a round whose peers
        already average it is closed, so a node arriving then waits for the next round's θ_g
        instead of training a round nobody will average with it, and a round that closes
        during the download sends it back for the next one. The swarm's round is the upper
        median over the peers, not their maximum: one node that raced ahead alone must not
        pull everyone onto its branch. A node that was training keeps its inner AdamW state
        and data position through the download (no warmup restart)."""
        lag = 0 if joining else self.settings.max_lag
        deadline = time.monotonic() + self.settings.join_timeout
        synced, downloads, waiting = False, 0, False
        while not self.stop_requested.is_set():
            view = await self.membership.members()
            if joining:
                self._check_model(view)
                self._check_data_plane(view)
            position = swarm_position(view.values(), self.peer_id, self.model_hash)
            own = self.replica.outer_step
            if position is None:
                return synced
            behind = position.start_step > own + lag
            ahead = own > position.start_step + 1 + lag
            if not behind and not ahead:
                if synced:  # from where the swarm is now: the download may have brought a newer step than asked
                    self._catch_up_round = position.round if position.round == own + 1 else None
                return synced
            if not position.ready:  # its peers are still applying the outer step that opens it
                if time.monotonic() > deadline:
                    log.warning("the swarm's round %d did not open within %.0fs (--join-timeout); training from "
                                "outer step %d meanwhile", position.round, self.settings.join_timeout, own)
                    return synced
                if not waiting:
                    log.info("the swarm is closing round %d; waiting for the θ_g of step %d that opens round %d "
                             "(peers: %s)", position.round - 1, position.start_step, position.round,
                             ", ".join(f"{r.peer_id[-6:]} {r.state} round {r.round} {r.phase or '-'} step {r.outer_step}"
                                       for r in view.values() if r.peer_id != self.peer_id))
                    waiting = True
                await self._wait_or_stop(asyncio.sleep(PACER_POLL_S))
                continue
            if downloads == MAX_SYNC_DOWNLOADS:
                log.warning("the swarm's round moved on during %d downloads in a row; training from outer step %d",
                            downloads, own)
                return synced
            downloads += 1
            if ahead:
                log.warning("this node is at outer step %d, ahead of the swarm at %d (rounds it made while cut off): "
                            "giving them up for the swarm's state", own, position.start_step)
            else:
                log.info("the swarm is in round %d (from outer step %d), this node at outer step %d: downloading a "
                         "checkpoint", position.round, position.start_step, own)
            started = time.monotonic()
            if await self._download(view, position.start_step, own):
                synced, lag = True, 0  # in step now, unless the round closed meanwhile: the loop checks
                self.joined_at = started
                # --overlap peers train round r from θ_g of step r-1: this node trains round r too
                self._catch_up_round = position.round if position.round == self.replica.outer_step + 1 else None
            elif (await self._position_moved(position)) is False:
                return synced
        return synced

    def _compile_kernels(self) -> None:
        """TorchInductor's int8 kernels, once the first inner step is done (see
        Trainer.first_step_done); eager kernels until then."""
        while not self.stop_flag.is_set():
            if self.trainer.first_step_done.wait(0.5):
                use_fused_kernels(True)
                return

    def _check_model(self, view: dict[str, PeerRecord]) -> None:
        """Refuse to join a swarm that trains another model (or another tokenizer): peers of
        another config hash are never averaged with, so this node would train alone."""
        hashes = collections.Counter(r.model_hash for p, r in view.items()
                                     if p != self.peer_id and r.state != "stopped")
        if not hashes or self.model_hash in hashes:
            return
        theirs, count = hashes.most_common(1)[0]
        raise JoinError(f"this swarm trains model config {theirs} ({count} peer(s)) and this node {self.model_hash}: "
                        f"give the same --model, --tokenizer and model files as the swarm "
                        f"(`curl <peer>/status` shows its model)")

    def _check_data_plane(self, view: dict[str, PeerRecord]) -> None:
        """Refuse to join a swarm whose peers average over the other kind of data plane: TLS and
        plaintext peers cannot open streams to each other, so every round would lose them."""
        tls = self.trust is not None
        other = sorted(p for p, r in view.items()
                       if p != self.peer_id and r.state != "stopped" and bool(r.tls_cert) != tls)
        if other:
            theirs, mine = ("plaintext", "TLS") if tls else ("TLS", "plaintext")
            fix = "add --insecure-data-plane" if tls else "drop --insecure-data-plane"
            who = f"peer {other[0]}" if len(other) == 1 else f"{len(other)} peers ({other[0]}, ...)"
            verb = "averages" if len(other) == 1 else "average"
            raise JoinError(f"{who} of this swarm {verb} over a {theirs} data plane and this node over {mine}: "
                            f"every peer of a swarm must use the same ({fix} to join this one)")

    async def _position_moved(self, position: SwarmPosition) -> bool:
        """Whether the swarm's open round has changed since `position` (a failed download is then retried)."""
        now = swarm_position((await self.membership.members()).values(), self.peer_id, self.model_hash)
        return now is not None and now.start_step != position.start_step

    async def _download(self, view: dict[str, PeerRecord], step: int, own: int) -> bool:
        """Fetch and install the swarm's checkpoint of `step` (or the next, if the swarm moved on)."""
        if self._in_flight is not None:  # the download replaces the θ_g that average was for
            await self._settle_in_flight(self.settings.matchmaking_window + self.settings.allreduce_timeout)
            self._arrival, self._landed = None, True
        previous_state, self.state, self.round_phase = self.state, "syncing", ""
        try:
            loaded = await fetch_from_swarm(view, self.peer_id, range(step, step + 2), self.model_hash,
                                            self.settings.run_id, self.layout, self.state_dir,
                                            self.settings.join_timeout, self.auth, keep=True)
        finally:
            self.state = previous_state
        if loaded is None:
            log.warning("no peer could serve the checkpoint of step %d; continuing from outer step %d", step, own)
            return False
        keep_inner = self.trainer.inner_step > 0
        loop = asyncio.get_running_loop()
        installing = time.monotonic()
        if self._hash_task is not None:  # it reads the θ_g about to be replaced
            await asyncio.gather(self._hash_task, return_exceptions=True)
        await loop.run_in_executor(self.train_thread, self._install, loaded, None, keep_inner)
        loaded.timings["installing"] = time.monotonic() - installing
        self._hash_task = asyncio.ensure_future(self._rehash())  # for the record and logs: off the join's path
        if self._pending_write is not None:
            await asyncio.gather(self._pending_write, return_exceptions=True)
        if loaded.step < own:
            moved = await loop.run_in_executor(self.io_thread, set_aside_checkpoints_after, self.state_dir,
                                               loaded.step)
            self.checkpoints = {st: i for st, i in self.checkpoints.items() if st <= loaded.step}
            log.info("moved this node's checkpoints of steps %s to %s", moved, self.state_dir / ABANDONED_DIR)
        await self._keep_downloaded(loaded)
        self._needs_resync = True  # the donor's θ_g may differ slightly from its neighbours'
        stages = ", ".join(f"{stage} {seconds:.1f}s" for stage, seconds in loaded.timings.items())
        log.info("in sync at outer step %d%s%s", loaded.step, f" ({stages})" if stages else "",
                 "; inner optimizer state kept" if keep_inner else "")
        await self.membership.announce(self.record())
        return True

    async def _shutdown(self) -> None:
        self.stop_requested.set()
        self.stop_flag.set()
        if self._in_flight is not None:  # still a member of its groups until the average is in
            try:
                await self._drain_in_flight()
            except Exception as e:
                log.error("could not apply the last round's average (%s: %s)", type(e).__name__, e)
        self.state = "stopped"
        if self._pending_write is not None:
            await asyncio.gather(self._pending_write, return_exceptions=True)
        if getattr(self, "replica", None) is not None and self.replica.outer_step not in self.checkpoints \
                and self.replica.outer_step > 0:
            await self._write_checkpoint()
        if self.remember_task is not None:
            self.remember_task.cancel()
            await asyncio.gather(self.remember_task, return_exceptions=True)
            try:
                self.known_peers.save()
            except OSError as e:
                log.warning("could not save the known peers: %s", e)
        if self.heartbeat_task is not None:
            await asyncio.gather(self.heartbeat_task, return_exceptions=True)
            try:  # tell peers at once, so no group waits for us; the record then expires
                await asyncio.wait_for(self.membership.announce(self.record()), 2.0)
            except Exception:
                pass
        await self.sidecar.stop()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=1.0)
        await self.channels.close()
        await asyncio.to_thread(self.dht.shutdown)
        self.train_thread.shutdown(wait=True, cancel_futures=True)
        self.io_thread.shutdown(wait=True)
        # up to the end of the last round: a node that runs on has no final wait for its last average
        utilization = self.compute_utilization(self.last_round_end_at) if self.last_round_end_at else None
        log.info("stopped at outer step %d%s", self.replica.outer_step if hasattr(self, "replica") else 0,
                 f"; {utilization:.1%} of the time from the first round's start to the last one's end was spent "
                 f"in inner steps" if utilization is not None else "")

    # ---- one outer round ------------------------------------------------------------------
    async def _guarded_round(self) -> None:
        """One round behind an error boundary: no exception inside a round ends the node.

        θ_g only changes in whole steps (outer step, adoption of a re-sync, a download), so
        a round that fails leaves θ_g as it was; θ_l keeps its inner progress, which the
        next round's Δ carries. The failure is logged with its cause, counted by type, and
        the next groups are asked to re-sync θ_g.
        """
        try:
            await self.run_round()
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as e:
            reason = type(e).__name__
            self.round_failures += 1
            self.metrics.round_failures.labels(reason=reason).inc()
            self.metrics.rounds.labels(outcome="failed").inc()
            self._recent_outcomes.append("failed")
            log.error("round %d failed (%s: %s); continuing from outer step %d with a re-sync",
                      self.replica.outer_step, reason, e, self.replica.outer_step, exc_info=e)
            self._needs_resync = True
            self._enter_round(self.replica.outer_step + (1 if self._in_flight is not None else 0))
            if isinstance(e, FloatingPointError):  # θ_l (and its optimizer state) are unusable
                await asyncio.get_running_loop().run_in_executor(self.train_thread, self._reset_local)
            await self._wait_or_stop(asyncio.sleep(1.0))  # a fault that repeats must not spin

    def _reset_local(self) -> None:
        self.replica.reset_local()
        self.trainer.load_inner_state(torch.empty(0), torch.empty(0), 0)

    async def _inner_steps(self, round_no: int) -> InnerResult:
        """Inner steps until the swarm's round ends (--pacing swarm) or for exactly H steps."""
        s = self.settings
        if self.first_round_at is None:
            self.first_round_at = time.monotonic()
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + s.round_seconds if s.round_seconds else None
        schedule = {"position": round_no * s.inner_steps, "span": s.inner_steps,
                    "after_step": partial(self._land_on_arrival, loop) if s.overlap else None}
        if s.pacing == "fixed":
            return await loop.run_in_executor(self.train_thread, partial(
                self.trainer.run, s.inner_steps, self.stop_flag, deadline, **schedule))
        self._round_end_at = math.inf

        def keep_going(step_seconds: float) -> bool:
            # start a step only if it ends no later than half a step past the swarm's round end
            return time.monotonic() + 0.5 * step_seconds <= self._round_end_at

        pacer = asyncio.ensure_future(self._pace(round_no))
        try:
            return await loop.run_in_executor(self.train_thread, partial(
                self.trainer.run, MAX_ROUND_FACTOR * s.inner_steps, self.stop_flag, deadline, keep_going, **schedule))
        finally:
            pacer.cancel()
            await asyncio.gather(pacer, return_exceptions=True)

    async def _pace(self, round_no: int) -> None:
        """Follow the swarm's progress in this round and move the round's expected end."""
        s = self.settings
        while True:
            try:
                view = await self.membership.members()
                # records count as published, not extrapolated: see peers/pacing.py
                progress = swarm_progress(view.values(), self.record(), round_no, s.inner_steps, s.round_tokens,
                                          get_dht_time(), max_extrapolation=0.0)
                self.round_progress = progress
                self._round_end_at = time.monotonic() + progress.seconds_left()
                if self._closed_before_joined(view, round_no):
                    self._round_end_at = -math.inf  # joined in the round's last seconds: see run_round
            except Exception as e:  # a failed read keeps the last estimate; the next poll retries
                log.warning("reading the swarm's progress failed: %s", e)
            await asyncio.sleep(PACER_POLL_S)

    async def run_round(self) -> None:
        s = self.settings
        if s.overlap:
            return await self._run_overlapped_round()
        loop = asyncio.get_running_loop()
        round_started = time.monotonic()
        if (trained := await self._train_round()) is None:
            return
        round_no, inner = trained
        view = await self.membership.members()
        if self._closed_before_joined(view, round_no) and await self._enter_next_round(round_no, inner):
            return
        delta = await loop.run_in_executor(self.train_thread, self.replica.pseudo_gradient)
        self.state, self.round_phase, self._first_group_formed = "averaging", "averaging", False
        await self.membership.announce(self.record())
        scheduled = bool(s.consensus_every) and round_no % s.consensus_every == s.consensus_every - 1
        resync = self._needs_resync or scheduled
        # a peer that took no step still averages (its θ_g stays in step), with a negligible weight
        result = await self.averager.average(
            round_no, delta, self.replica.mean_cpu, float(max(inner.tokens, 1)), resync,
            lambda: loop.run_in_executor(self.train_thread, self.replica.consensus_state), self.residual,
            self.replica.delta_on_host)
        # a wanted re-sync that found nobody to sync with is still wanted next round
        self._needs_resync = not result.clean or (resync and result.theta is None)
        if all(h.group_size <= 1 for h in result.hops) and self._closed_before_joined(
                await self.membership.members(), round_no, alone=True) and await self._enter_next_round(round_no, inner):
            return  # the records it judged by were a heartbeat behind
        self._reentries = 0
        self.phase = "outer"
        if self._hash_task is not None:  # the hash of the previous θ_g reads it: let it finish
            await asyncio.gather(self._hash_task, return_exceptions=True)
        await loop.run_in_executor(self.train_thread, self._apply, result)
        self.round_phase = "outer"
        await self.membership.announce(self.record())  # a joiner may download the new θ_g at once
        self._hash_task = asyncio.ensure_future(self._rehash())
        await failpoints.pause("outer-phase", round_no)
        if self._eval_due():
            await loop.run_in_executor(self.train_thread, self._evaluate_local)
        self.rounds_done += 1
        if self.replica.outer_step % s.checkpoint_every == 0:
            await self._schedule_checkpoint()
        self._enter_round(self.replica.outer_step)
        self._report(round_no, inner, result, time.monotonic() - round_started)
        await self.membership.announce(self.record())

    def _closed_before_joined(self, view: dict[str, PeerRecord], round_no: int, alone: bool = False) -> bool:
        """Whether the swarm's open round moved past `round_no`, the first this node trains
        after a download, while this node trained it: its peers averaged it without this node
        (with `alone`: this node's average found no group while the swarm has peers). At most
        MAX_REENTRIES rounds in a row are given up so: a node that can never reach a group
        (unreachable, always late) trains on rather than downloading every round."""
        if self.settings.overlap or round_no != self._entered_round or self._reentries >= MAX_REENTRIES:
            return False
        position = swarm_position(view.values(), self.peer_id, self.model_hash)
        return position is not None and (alone or position.round > round_no)

    async def _enter_next_round(self, round_no: int, inner: InnerResult) -> bool:
        """A joiner that arrived in a round's last seconds, whose peers averaged it before its
        first steps were done: it takes the θ_g of the next round instead of averaging alone
        (a θ_g of its own that the swarm never had). Those few steps are a Δ nobody can average
        any more; they are dropped with the round. False (the round goes on as it is) when the
        swarm turns out not to have moved on, or no peer served its θ_g."""
        self._reentries += 1
        if not await self._sync_with_swarm(joining=True):
            return False
        log.info("round %d closed while this node took its first %d step(s) in it; it joined the swarm's open round",
                 round_no, inner.steps)
        self.trainer.round_tokens, self.trainer.round_seconds = 0, 0.0
        return True

    def compute_utilization(self, until: float | None = None) -> float | None:
        """The fraction of wall time since the first round began (up to `until`, monotonic;
        default now) spent in inner steps."""
        if self.first_round_at is None:
            return None
        end = time.monotonic() if until is None else until
        return min(1.0, self.inner_seconds / max(end - self.first_round_at, 1e-9))

    async def _train_round(self) -> tuple[int, InnerResult] | None:
        """A round's inner steps, after a catch-up if the swarm left this node far behind (stalled,
        partitioned); None when a stop ended them. The round is the outer step being built, one
        past θ_g's while an average is in flight (--overlap)."""
        await self._sync_with_swarm()
        ahead = self._in_flight is not None or self._catch_up_round == self.replica.outer_step + 1
        round_no = self.replica.outer_step + (1 if ahead else 0)
        self._training_round = round_no  # published with --overlap: pacing counts this round's tokens under it
        self._enter_round(round_no)
        self._entered_round = round_no if self.joined_at is not None else None
        if self.joined_at is not None:
            await asyncio.wrap_future(self.trainer.build_optimizer_in_background())  # the first step needs it
            position = swarm_position((await self.membership.members()).values(), self.peer_id, self.model_hash)
            log.info("training round %d with the swarm (%s), %.1fs after the download began", round_no,
                     "no other peer" if position is None else f"its open round is {position.round}, "
                     f"{position.peers} other peer(s)", time.monotonic() - self.joined_at)
            self.joined_at = None
        inner = await self._inner_steps(round_no)
        if self.stop_requested.is_set():
            log.info("round %d abandoned after %d inner steps", round_no, inner.steps)
            return None
        self._observe_inner(round_no, inner)
        failpoints.reach("round-error", round_no)
        return round_no, inner

    def _enter_round(self, round_no: int) -> None:
        """Round `round_no` is open on this node: its inner steps start (or are about to)."""
        self.round_no, self.round_start_step, self.round_phase = round_no, self.replica.outer_step, "inner"
        self.state, self.phase = "training", "inner"

    def _observe_inner(self, round_no: int, inner: InnerResult) -> None:
        self.inner_seconds += inner.seconds
        if self.settings.pacing == "swarm" and (p := self.round_progress) is not None:
            log.debug("round %d ends after %d steps: swarm %.0f of %d tokens from %d peers, %.0f tok/s", round_no,
                      inner.steps, p.done, p.target, p.peers, p.rate)
        if inner.seconds > 0 and inner.tokens:
            self.tokens_per_s = inner.tokens / inner.seconds
            # the smaller of the last round and a running mean: one round with the machine to itself is no rule
            self.rate_estimate = min(self.tokens_per_s, 0.5 * (self.rate_estimate + self.tokens_per_s)) \
                if self.rate_estimate else self.tokens_per_s

    # ---- --overlap: the averaging of round t runs during the inner steps of round t+1 ------
    async def _run_overlapped_round(self) -> None:
        """Inner steps while the previous round's Δ is averaged; then that average's outer step
        if it has not landed yet, and this round's Δ goes out to be averaged during the next round.

        The trade-off (streaming DiLoCo's overlapped outer step): the network's time hides
        behind compute, while the first steps of each round run from a θ_g that lacks the last
        round's average, with the node's own part of it kept in θ_l. The average's outer step
        lands between two inner steps as soon as it is in (`_land_on_arrival`), so those are
        few when the average is quick; at the round's end this waits for one still running.
        """
        s = self.settings
        loop = asyncio.get_running_loop()
        round_started = time.monotonic()
        if (trained := await self._train_round()) is None:
            return
        round_no, inner = trained
        self.round_phase = "averaging"
        previous = await self._settle_in_flight()
        self.phase = "outer"
        if self._hash_task is not None:
            await asyncio.gather(self._hash_task, return_exceptions=True)
        delta = None
        if self._catch_up_round == round_no and previous is None:
            self._catch_up_round = None
            delta = await self._catch_up(round_no)
        # θ_g moves now (a new hash): a catch-up, or an average that did not land during the steps
        changed = delta is not None or (previous is not None and not self._landed)
        landed_after = self._landed_after_steps if previous is not None and self._landed else inner.steps
        if delta is None:
            delta = await loop.run_in_executor(self.train_thread, self._apply_delayed, previous)
        self.round_phase = "outer"
        if changed:
            self._hash_task = asyncio.ensure_future(self._rehash())
        scheduled = bool(s.consensus_every) and round_no % s.consensus_every == s.consensus_every - 1
        resync = self._needs_resync or scheduled
        self._resync_asked = resync
        # θ_g does not change while the average runs (only its outer step, awaited first, writes
        # it): the consensus state is read on the I/O thread, not behind this round's inner steps
        self._arrival, self._landed, self._landed_after_steps = None, False, None
        self._in_flight = asyncio.ensure_future(self._arrive(self.averager.average(
            round_no, delta, self.replica.mean_cpu, float(max(inner.tokens, 1)), resync,
            lambda: loop.run_in_executor(self.io_thread, self.replica.consensus_state), self.residual,
            self.replica.delta_on_host)))
        if previous is not None:  # the new θ_g's eval, once its hash and the next average are under way
            await loop.run_in_executor(self.train_thread, self._evaluate_theta_g)
        self.rounds_done += 1
        if previous is not None and self.replica.outer_step % s.checkpoint_every == 0:
            await self._schedule_checkpoint()
        self._training_round = round_no + 1  # peers count this node in the next round at once
        self._enter_round(round_no + 1)
        self._report(round_no, inner, previous, time.monotonic() - round_started,
                     landed_after if previous is not None else None)
        await self.membership.announce(self.record())

    async def _arrive(self, averaging: Awaitable[AveragingResult]) -> AveragingResult:
        """--overlap: the average in flight; once it is in (and the hash of the θ_g it will
        change is done), the training thread may land it between two inner steps."""
        result = await averaging
        if self._hash_task is not None:
            await asyncio.gather(self._hash_task, return_exceptions=True)
        self._arrival = result
        return result

    def _land_on_arrival(self, loop: asyncio.AbstractEventLoop) -> None:
        """--overlap, on the training thread after each inner step: the outer step of the
        previous round's average as soon as it is in, rather than at this round's end."""
        if self._landed or (result := self._arrival) is None:
            return
        self._land(result)
        self._landed_after_steps = self.trainer.round_steps
        host = self.replica.host_theta()  # on this thread: no wait behind the round's steps
        loop.call_soon_threadsafe(self._rehash_landed, host)

    def _rehash_landed(self, host: torch.Tensor) -> None:
        self._hash_task = asyncio.ensure_future(self._rehash(host))

    def _land(self, result: AveragingResult | None) -> None:
        """On the training thread: the outer step of the average in flight (None: it failed)."""
        self._landed = True
        with self._theta_changing():
            self.replica.land(None if result is None else result.mean, None if result is None else result.theta)

    async def _settle_in_flight(self, timeout: float | None = None) -> AveragingResult | None:
        """The average in flight, once done; None when there is none or it failed (whose Δ
        then goes out again inside the next one's)."""
        task, self._in_flight = self._in_flight, None
        if task is None:
            return None
        self.phase = "averaging"
        started = time.monotonic()
        await asyncio.wait({task}, timeout=timeout)  # a wait that ends never cancels the average itself
        self._waited_s += time.monotonic() - started
        result: AveragingResult | None = None
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            log.error("averaging round %d did not end in %.0fs; given up", self.replica.outer_step, timeout)
        elif task.cancelled():
            pass
        elif (e := task.exception()) is not None:
            log.error("averaging round %d failed (%s: %s); its Δ goes out again with the next round's",
                      self.replica.outer_step, type(e).__name__, e, exc_info=e)
            self.metrics.round_failures.labels(reason=type(e).__name__).inc()
        else:
            result = task.result()
        if result is None:
            self._needs_resync = True
            return None
        self._needs_resync = not result.clean or (self._resync_asked and result.theta is None)
        return result

    async def _catch_up(self, round_no: int) -> torch.Tensor | None:
        """--overlap, the first round after a download: this node entered round r from θ_g of
        step r-1, as the swarm did, but took no part in the average of round r-1 that the
        swarm applies now. So instead of an outer step of its own it takes the swarm's θ_g of
        step r once a peer holds it (the delayed outer step, done by the swarm), and sends this
        round's Δ out with theirs. None when no peer could serve it in time (the round then
        goes on as after a failed average, and the next groups re-sync θ_g)."""
        s = self.settings
        deadline = time.monotonic() + s.matchmaking_window + s.allreduce_timeout
        while not self.stop_requested.is_set() and time.monotonic() < deadline:
            view = await self.membership.members()
            if any(r.outer_step >= round_no and r.model_hash == self.model_hash for r in view.values()
                   if r.peer_id != self.peer_id and r.state in ("training", "averaging")):
                loaded = await fetch_from_swarm(view, self.peer_id, range(round_no, round_no + 1), self.model_hash,
                                                s.run_id, self.layout, self.state_dir, s.join_timeout, self.auth,
                                                keep=True)
                if loaded is None:
                    break
                await self._keep_downloaded(loaded)

                def adopt() -> torch.Tensor:
                    self.trainer.round_tokens, self.trainer.round_seconds = 0, 0.0
                    with self._theta_changing():
                        delta = self.replica.delayed_outer_step(None, torch.cat([loaded.theta_g, loaded.momentum]))
                        self.replica.outer_step = loaded.step
                    self._evaluate_theta_g()
                    return delta

                delta = await asyncio.get_running_loop().run_in_executor(self.train_thread, adopt)
                log.info("took the swarm's θ_g of step %d for round %d (entered from a download)", loaded.step,
                         round_no)
                return delta
            await self._wait_or_stop(asyncio.sleep(PACER_POLL_S))
        log.warning("no peer served θ_g of step %d in time; round %d goes on as after a failed average",
                    round_no, round_no)
        self._needs_resync = True
        return None

    def _apply_delayed(self, result: AveragingResult | None) -> torch.Tensor:
        """On the training thread, at a round's end: the outer step of the previous average if
        it did not land during the steps, then this round's Δ staged."""
        self.trainer.round_tokens, self.trainer.round_seconds = 0, 0.0
        if not self._landed:
            self._land(result)
        return self.replica.stage_delta()

    def _eval_due(self) -> bool:
        every = self.settings.eval_every
        return bool(every) and self.replica.outer_step % every == 0

    def _evaluate_local(self) -> None:
        """On the training thread, right after an outer step (θ_l = θ_g): the eval loss of θ_g."""
        self.eval_loss, self.eval_step = self.trainer.eval_loss(), self.replica.outer_step

    def _evaluate_theta_g(self, force: bool = False) -> None:
        """The eval loss of θ_g while θ_l differs from it (--overlap): θ_g is swapped in for it."""
        if not (force or self._eval_due()):
            return
        self.replica.theta_g_into_model()
        try:
            self.eval_loss, self.eval_step = self.trainer.eval_loss(), self.replica.outer_step
        finally:
            self.replica.restore_local()

    async def _drain_in_flight(self) -> None:
        """--overlap, on the way out: the last average's outer step, so the final θ_g (and its
        checkpoint) holds every round this node took part in."""
        if self._in_flight is None:
            return
        s = self.settings
        result = await self._settle_in_flight(2 * (s.matchmaking_window + s.allreduce_timeout))
        loop = asyncio.get_running_loop()

        def settle() -> None:
            if not self._landed:
                self._land(result)
            if result is not None:
                self._evaluate_theta_g(force=bool(self.settings.eval_every))

        await loop.run_in_executor(self.train_thread, settle)
        if result is not None:
            await self._rehash()
            log.info("applied the last round's average: outer step %d (params %s)", self.replica.outer_step,
                     self.replica.params_sha256()[:12])

    def _apply(self, result: AveragingResult) -> None:
        """On the training thread: adopt a re-synced θ_g if any, then the outer step."""
        # this round's count goes first: a record must never show the next step with this
        # round's tokens, which every peer would add to the next round's progress
        self.trainer.round_tokens, self.trainer.round_seconds = 0, 0.0
        with self._theta_changing():
            if result.theta is not None:
                self.replica.adopt_consensus_state(result.theta)
            self.replica.apply_outer_step(result.mean)

    async def _rehash(self, host: torch.Tensor | None = None) -> None:
        """params_sha256 of the new θ_g: one device-to-host copy on the training thread, the
        hash on the I/O thread (θ_g does not change before the next outer step awaits this);
        then the checkpoint of this step, ready to be served from memory. A joiner asking for
        the step waits for this, so it runs beside the eval, not after it."""
        loop = asyncio.get_running_loop()
        if host is None:  # else copied already, by a landing between inner steps
            if self.replica.theta_on_host:  # nothing to copy: no wait behind the training thread's eval
                host = self.replica.host_theta()
            else:
                host = await loop.run_in_executor(self.train_thread, self.replica.host_theta)
        self.replica.set_params_sha256(await loop.run_in_executor(self.io_thread, sha256_of, host))
        await self._prepare_memory_checkpoint()

    async def _prepare_memory_checkpoint(self) -> None:
        """Hash θ_g and the momentum as this step's checkpoint file would hold them, so that a
        joiner's request is answered at once and served from the live tensors instead of
        waiting for the file to be written (a second or more on a busy host). CPU state only:
        on a GPU the checkpoint is written on demand, as a device copy would be made anyway."""
        replica = self.replica
        step, version = replica.outer_step, self._theta_version
        if (step == 0 or step in self.checkpoints or step in self._memory
                or replica.theta_g.device.type != "cpu" or replica.outer.momentum_buffer.device.type != "cpu"
                or failpoints.active_since("wrong-checkpoint", step)):
            return
        memory = MemoryCheckpoint(step, self.layout, replica.theta_g, replica.outer.momentum_buffer,
                                  self._checkpoint_metadata())
        await asyncio.get_running_loop().run_in_executor(self.io_thread, memory.hash)
        if self._theta_version != version:
            return  # θ_g changed while it was hashed: the hash is of neither
        in_use = self.sidecar.steps_in_use()
        for old in [s for s in self._memory if s not in in_use]:
            del self._memory[old]
        self._memory[step] = memory

    @contextlib.contextmanager
    def _theta_changing(self):
        """Hold the lock while θ_g or the momentum change. A checkpoint served from their memory
        goes on from copies if a joiner asked for it lately, and is dropped otherwise."""
        with self.theta_lock:
            self._theta_version += 1
            in_use = self.sidecar.steps_in_use() if hasattr(self, "sidecar") else set()
            for step, memory in list(self._memory.items()):
                if step in in_use:
                    memory.detach()
                else:
                    self._memory.pop(step, None)
            yield

    def memory_checkpoint(self, step: int) -> MemoryCheckpoint | None:
        memory = self._memory.get(step)
        return memory if memory is not None and memory.sha256 else None

    def _checkpoint_metadata(self) -> dict[str, str]:
        # the same bytes on every peer of a group (joiners fetch ranges of one file from several):
        # no local path, so an hf: model is named by its kind and its config in model_config
        model = "hf" if self.settings.model.startswith(HF_PREFIX) else self.settings.model
        return {"run_id": self.settings.run_id, "model_hash": self.model_hash, "model": model,
                "model_config": json.dumps(self.model_description, sort_keys=True),
                "init_seed": str(self.init_seed), "export_format": self.export_format}

    def _report(self, round_no: int, inner: InnerResult, result: AveragingResult | None, duration: float,
                landed_after: int | None = None) -> None:
        """The round line and record. With --overlap the groups, bytes and θ_g are those of the
        previous round's average (none after the first round), whose outer step landed after
        `landed_after` of this round's inner steps."""
        hops: list[HopReport] = result.hops if result is not None else []
        first = hops[0] if hops else HopReport(0, "", 1, 1, 0, True, [self.peer_id], 0.0, 0.0)
        self.last_round = {
            "outer_step": round_no, "group_size": first.group_size, "group_key": first.group_key,
            "included_peers": first.included_peers, "matchmaking_s": round(sum(h.matchmaking_s for h in hops), 4),
            "duration_s": round(duration, 4), "allreduce_s": round(sum(h.allreduce_s for h in hops), 4),
            "bytes_sent": sum(h.bytes_sent for h in hops), "bytes_received": sum(h.bytes_received for h in hops),
            "failed_parts": [p for h in hops for p in h.failed_parts],
            "weight_after": result.weight if result is not None else 0.0,
            "full": all(h.complete for h in hops), "hops": [h.as_dict() for h in hops], "inner_steps": inner.steps,
            "tokens": inner.tokens, "inner_s": round(inner.seconds, 4), "loss": inner.mean_loss,
            "eval_loss": self.eval_loss, "inner_lr": self.trainer.lr, "landed_after_steps": landed_after,
        }
        self._observe_round(round_no, inner, hops, duration)
        floor = self.sources.loss_floor
        groups = " ".join(f"{h.group_size}/{h.expected}" + (f"+{h.extra_groups}" if h.extra_groups else "")
                          for h in hops) or "-"
        loss = "-" if math.isnan(inner.mean_loss) else f"{inner.mean_loss:.4f}"
        held_out = "-" if self.eval_loss is None else f"{self.eval_loss:.4f}"
        if self.eval_loss is not None and self.eval_step != self.replica.outer_step:
            held_out += f"@{self.eval_step}"  # --eval-every: the last eval, of an earlier θ_g
        line = (f"round {round_no} | groups {groups} | {inner.steps} steps {inner.tokens} tok | lr "
                f"{self.trainer.lr:.3g} | loss {loss} | eval {held_out}{f' (floor {floor:.3f})' if floor else ''} | "
                f"allreduce {self.last_round['allreduce_s']:.3f}s ({_human_bytes(self.last_round['bytes_sent'])} "
                f"sent) | {self.tokens_per_s:.0f} tok/s | params ")
        self._log_naming_params(line, "")

    def _observe_round(self, round_no: int, inner: InnerResult, hops: list[HopReport], duration: float) -> None:
        """The round into the metrics and the history (written on the I/O thread)."""
        m = self.metrics
        matchmaking = sum(h.matchmaking_s for h in hops)
        allreduce = sum(h.allreduce_s + (h.theta_resync_s or 0.0) for h in hops)
        # overlapped, the average runs during inner steps: only the wait for it blocks the round
        averaging = self._waited_s if self.settings.overlap else matchmaking + allreduce
        evaluating, self.trainer.eval_seconds, self._waited_s = self.trainer.eval_seconds, 0.0, 0.0
        phases = {"inner": inner.seconds, "matchmaking": matchmaking, "allreduce": allreduce,
                  "waiting": averaging if self.settings.overlap else 0.0, "eval": evaluating,
                  "outer": max(0.0, duration - inner.seconds - averaging - evaluating)}
        reasons = [failure_reason(code) for h in hops for code in h.failure_codes]
        reasons += ["incomplete_group" for h in hops if not h.complete and h.group_size > 1]
        if not hops or all(h.group_size <= 1 for h in hops):
            outcome = "alone"
        else:
            outcome = "full" if all(h.clean for h in hops) else "partial"
        m.rounds.labels(outcome=outcome).inc()
        self._recent_outcomes.append(outcome)
        for reason in reasons:
            m.hop_failures.labels(reason=reason).inc()
        for code in (code for h in hops for code in h.retried_codes):
            m.stream_retries.labels(reason=failure_reason(code)).inc()
        m.outer_step.set(self.replica.outer_step)
        m.inner_step.set(self.trainer.inner_step)
        m.loss.set(inner.mean_loss)
        m.eval_loss.set(self.eval_loss if self.eval_loss is not None else math.nan)
        m.tokens_per_second.set(self.tokens_per_s)
        m.tokens.inc(inner.tokens)
        self.last_round_end_at = time.monotonic()
        m.compute_utilization.set(self.compute_utilization() or 0.0)
        m.group_size.set(hops[0].group_size if hops else 1)
        m.round_seconds.observe(duration)
        m.last_round_at.set(time.time())
        for phase, seconds in phases.items():
            m.phase_seconds.labels(phase=phase).observe(seconds)
        for h in hops:
            m.allreduce_sent.inc(h.bytes_sent)
            m.allreduce_received.inc(h.bytes_received)
            if h.allreduce_s:
                m.allreduce_seconds.observe(h.allreduce_s)
        entry = {
            "step": self.replica.outer_step, "round": round_no, "time": round(time.time(), 3),
            "loss": inner.mean_loss, "tokens": inner.tokens,
            "eval_loss": self.eval_loss if self.eval_step == self.replica.outer_step else None,
            "tokens_total": self.history.tokens_total + inner.tokens, "tokens_per_s": round(self.tokens_per_s, 1),
            "inner_steps": inner.steps, "lr": self.trainer.lr, "groups": [[h.group_size, h.expected] for h in hops],
            "bytes_sent": sum(h.bytes_sent for h in hops), "bytes_received": sum(h.bytes_received for h in hops),
            "phases_s": {k: round(v, 3) for k, v in phases.items()}, "duration_s": round(duration, 3),
            "outcome": outcome, "reasons": sorted(set(reasons)),
            "landed_after_steps": self.last_round.get("landed_after_steps"),
        }
        asyncio.get_running_loop().run_in_executor(self.io_thread, self.history.persist, self.history.append(entry))

    def _log_naming_params(self, before: str, after: str) -> None:
        """Log a line that names θ_g's hash, once the hash (computed off the training thread) is in."""
        task = self._hash_task
        if task is None or task.done():
            log.info("%s%s%s", before, self.replica.params_sha256()[:12], after)
        else:
            task.add_done_callback(lambda _: log.info("%s%s%s", before, self.replica.params_sha256()[:12], after))

    async def _schedule_checkpoint(self) -> None:
        """Write this step's checkpoint in the background (one write at a time)."""
        if self._pending_write is not None:
            await asyncio.gather(self._pending_write, return_exceptions=True)
        self._pending_write = asyncio.ensure_future(self._write_checkpoint())

    async def current_checkpoint(self) -> CheckpointInfo | None:
        """The checkpoint of the current outer step, written now if the cadence skipped it.

        A peer catching up needs the swarm's current θ_g, not the last one the cadence kept;
        θ_g and the momentum do not change during inner steps, so they are copied (under the
        lock the outer step takes) without waiting for the training thread.
        """
        newest = self.checkpoint()
        step = self.replica.outer_step if hasattr(self, "replica") else 0
        if step == 0 or (newest is not None and newest.step >= step) or self.state not in ("training", "averaging"):
            return newest
        if self._hash_task is not None and not self._hash_task.done():  # the step's hash is under way
            await asyncio.wait({asyncio.shield(self._hash_task)}, timeout=30)
        if (memory := self.memory_checkpoint(step)) is not None:
            return memory.info
        for _ in range(2):  # a write already under way may be of an older step
            if self._pending_write is None or self._pending_write.done():
                self._pending_write = asyncio.ensure_future(self._write_checkpoint(local=False))
            await asyncio.wait_for(asyncio.shield(self._pending_write), 60)
            newest = self.checkpoint()
            if newest is not None and newest.step >= step:
                break
        return newest

    def _snapshot(self, local: bool) -> tuple[int, TrainingState]:
        """θ_g and momentum (and with `local`, this node's inner state: training thread only)."""
        with self.theta_lock:
            step = self.replica.outer_step
            theta = self.replica.theta_g.detach().to("cpu", copy=True)
            momentum = self.replica.outer.momentum_buffer.to("cpu", copy=True)
        own = None
        if local:
            exp_avg, exp_avg_sq, adam_steps = self.trainer.inner_state()
            generator, batches = self.trainer.stream.position()
            own = LocalState(exp_avg, exp_avg_sq, generator, self.trainer.inner_step, adam_steps, batches)
        return step, TrainingState(theta, momentum, own)

    async def _write_checkpoint(self, local: bool = True) -> None:
        """Snapshot (the only work on the training thread, or none without `local`), write on the I/O thread."""
        loop = asyncio.get_running_loop()
        step, state = await loop.run_in_executor(self.train_thread if local else self.io_thread, self._snapshot, local)
        if failpoints.active_since("wrong-checkpoint", step):  # a lying donor, for tests (its own θ_g is untouched)
            state.theta_g.add_(1.0)
        metadata = self._checkpoint_metadata()
        try:
            # on demand for a joiner (not `local`): the joiner waits for it, so no fsync
            started = time.monotonic()
            info = await loop.run_in_executor(self.io_thread, partial(
                write_checkpoint, self.state_dir, step, self.layout, state, metadata, durable=local))
            self.metrics.checkpoint_write_seconds.observe(time.monotonic() - started)
        except OSError as e:
            log.error("could not write checkpoint %d: %s", step, e)
            return
        self.checkpoints[step] = info
        await self._prune()

    async def _keep_downloaded(self, loaded: LoadedCheckpoint) -> None:
        """The donors' file is this node's checkpoint of that step: registered, never rewritten."""
        self.metrics.catchups.inc()
        if loaded.file is not None:
            self.metrics.checkpoint_downloaded.inc(loaded.file.size_bytes)
            self.checkpoints[loaded.step] = loaded.file
            await self._prune()

    async def _prune(self) -> None:
        """Keep the newest --keep-checkpoints, and any a joiner is still downloading."""
        kept = await asyncio.get_running_loop().run_in_executor(
            self.io_thread, prune_checkpoints, self.state_dir, self.settings.keep_checkpoints,
            self.sidecar.steps_in_use())
        self.checkpoints = {s: i for s, i in self.checkpoints.items() if s in kept}


def _human_bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def check_ports(s: NodeSettings) -> None:
    """End at once, naming the option, when a port this node must listen on is taken."""
    wanted = [("--dht-port", s.dht_port), ("--http-port", s.http_port)]
    if not s.client_mode:
        wanted.append(("--grpc-port", s.grpc_port))
    seen: dict[int, str] = {}
    for option, port in wanted:
        if not port:
            continue
        if port in seen:
            raise SettingsError(option, f"port {port} is also given to {seen[port]}; each needs its own")
        seen[port] = option
        if port_in_use(s.host, port):
            raise SettingsError(option, f"port {port} on {s.host} is in use (another dtnode on this host? give "
                                        f"each node its own ports, or 0 for any free one)")


async def run_node(settings: NodeSettings) -> int:
    check_ports(settings)
    node = Node(settings)
    return await node.run()


__all__ = ["Node", "run_node", "JoinError"]
