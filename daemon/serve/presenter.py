"""What peers and operators read of a node: its membership record, `/status`, `/healthz`,
`/peers`, and the checkpoints the sidecar serves (the sidecar's `NodeView`).

It only reads the node's parts, never moves them: every value comes from the part that owns
it (the round state, the worker, the store, the run statistics, the last round's summary).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from dtnode import __version__
from dtnode.daemon.checkpoints.file_format import CheckpointInfo
from dtnode.daemon.checkpoints.in_memory import MemoryCheckpoint
from dtnode.daemon.checkpoints.store import CheckpointStore
from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.records.history import RoundHistory
from dtnode.daemon.records.report import RoundOutcome, RunStats
from dtnode.daemon.records.state import RoundState
from dtnode.daemon.records.status import Health, NodeStatus, RankStatus, RoundProgress, SyncMiss
from dtnode.daemon.swarm.reachability import DialBack, Reachability
from dtnode.daemon.telemetry.metrics import NodeMetrics
from dtnode.daemon.training.worker import ModelWorker
from dtnode.daemon.workload.build import Workload
from dtnode.ops.quantization import fused_kernels_active
from dtnode.peers import failpoints
from dtnode.peers.deadlines import AdaptiveDeadlines, expected_payload_bytes
from dtnode.peers.hivemind_adapter import get_dht_time
from dtnode.peers.membership import Membership, PeerRecord
from dtnode.peers.tls import TrustStore, certificate_signature

READY_ROUNDS = 3  # /readyz: a node that averaged with a peer in none of its last 3 rounds is not ready


def _recordable_loss(loss: float | None) -> float | None:
    """The record's loss: a finite one within the record's bounds, else none (a NaN or an
    exploded loss would make the whole record invalid to its readers)."""
    return loss if loss is not None and math.isfinite(loss) and 0 <= loss <= 1e6 else None


@dataclass
class Addresses:
    """Where peers reach this node (filled in as its services start)."""

    peer_id: str = ""
    grpc_addr: str = ""
    http_addr: str = ""
    dht_addrs: tuple[str, ...] = ()
    join_command: str = ""


@dataclass
class NodePresenter:
    settings: NodeSettings
    addr: Addresses
    device: torch.device
    workload: Workload
    state: RoundState
    stats: RunStats
    worker: ModelWorker
    store: CheckpointStore
    membership: Membership
    deadlines: AdaptiveDeadlines
    trust: TrustStore | None
    metrics: NodeMetrics
    history: RoundHistory
    started_at: float
    dial_back_server: DialBack
    reachability: Reachability | None = None  # a peer's dial-back of this node, once one answered

    async def dial_back(self, peer_id: str) -> Reachability | None:
        return await self.dial_back_server.dial(peer_id)

    @property
    def metrics_registry(self) -> CollectorRegistry:
        return self.metrics.registry

    @property
    def export_format(self) -> str:
        return self.workload.export_format

    def record(self) -> PeerRecord:
        s, st, trainer = self.settings, self.state, self.worker.trainer
        newest = self.store.announced()
        lying = failpoints.hostile(self.worker.outer_step) == "hostile-pacing"  # a test's attacker
        return PeerRecord(
            peer_id=self.addr.peer_id,
            grpc_addr=self.addr.grpc_addr,
            http_addr=self.addr.http_addr,
            state=st.state.value,
            outer_step=self.worker.outer_step,
            checkpoint_step=newest.step if newest else -1,
            checkpoint_sha256=newest.sha256 if newest else "",
            served=tuple(f"{step}:{sha}" for step, sha in self.store.recently_served()),
            tokens_per_s=self.stats.live_rate(trainer.round_tokens, trainer.tokens_per_step, trainer.round_seconds),
            round_tokens=int(failpoints.HOSTILE_TOKENS) if lying else trainer.round_tokens,
            training_round=st.training_round if s.diloco.overlap else -1,
            round=st.round if st.in_round else -1,
            phase=st.published_phase().value,
            round_checkpoint=st.start_step if st.in_round else -1,
            first_round=-1 if st.first_round is None else st.first_round,
            round_began_at=st.round_began_at,
            grid_dims=st.grid_dims,
            dht_addrs=self.addr.dht_addrs,
            tokens_per_step=1 << 40 if lying else trainer.tokens_per_step,
            progress_at=self._counted_at(trainer.running, trainer.progress_at),
            bandwidth_mbps=s.network.bandwidth_mbps,
            device=self._devices(),
            client_mode=s.network.client_mode,
            model_hash=self.workload.model_hash,
            version=__version__,
            recipe_sha256=self.recipe_sha256,
            wire_protocol=self.workload.recipe.wire_protocol,
            tls_sig=self.tls_sig,
            theta_sha256=self.worker.replica.params_sha256() if self.worker.built else "",
            loss=_recordable_loss(trainer.last_loss),
            condition=self.stats.condition(st.state)[0].value,
        )

    @functools.cached_property
    def recipe_json(self) -> str:
        """The recipe as the sidecar serves it at /recipe (its hash is in the record)."""
        return self.workload.recipe.to_record()

    @functools.cached_property
    def recipe_sha256(self) -> str:
        return self.workload.recipe.sha256

    @functools.cached_property
    def tls_sig(self) -> str:
        """The record's TLS field: this node's certificate signature (none: plaintext)."""
        return certificate_signature(self.trust.own.cert_der) if self.trust is not None else ""

    def _devices(self) -> str:
        """The record's device: `cuda:0`, or `8xcuda` for a host training on several."""
        ranks = self.worker.ranks
        return f"{ranks.world_size}x{self.device.type}" if ranks is not None else str(self.device)

    @staticmethod
    def _counted_at(running: bool, last_step_end: float) -> float:
        """DHT time at which `round_tokens` was true: the end of the last inner step while the
        training thread is in its steps (peers extrapolate from there), else now."""
        now = get_dht_time()
        return now - max(0.0, time.monotonic() - last_step_end) if running else now

    def status(self) -> NodeStatus:
        s, w = self.settings, self.worker
        trainer = w.trainer if w.built else None
        summary, progress = self.stats.last, self.stats.round_progress
        condition, detail = self.stats.condition(self.state.state)
        return NodeStatus(
            peer_id=self.addr.peer_id,
            run_id=s.swarm.run_id,
            state=self.state.state,
            phase=self.state.phase.value,
            outer_step=w.outer_step,
            inner_step=trainer.inner_step if trainer else 0,
            inner_lr=trainer.lr if trainer else None,
            loss=trainer.last_loss if trainer else None,
            eval_loss=w.eval_loss,
            eval_step=w.eval_step,
            loss_floor=self.workload.sources.loss_floor,
            tokens_per_s=self.stats.tokens_per_s,
            compute_utilization=self.stats.utilization(),
            uptime_s=time.time() - self.started_at,
            params_sha256=w.replica.params_sha256() if w.built else "",
            http_url=self.addr.http_addr,
            grpc_addr=self.addr.grpc_addr,
            join_command=self.addr.join_command,
            dht_addrs=list(self.addr.dht_addrs),
            tls_fingerprint=self.trust.own.fingerprint if self.trust else None,
            model=s.workload.model,
            model_hash=self.workload.model_hash,
            recipe=self.workload.recipe,
            max_rounds=s.diloco.max_rounds,
            device=self._devices(),
            client_mode=s.network.client_mode,
            reachability=self.reachability,
            version=__version__,
            last_round=summary.last_round() if summary else None,
            deadlines=self.deadlines.snapshot(
                self._expected_bytes(summary.hops[0].group_size if summary and summary.hops else 2)
            ),
            fused_kernels=fused_kernels_active(),
            pacing=s.diloco.pacing,
            round_failures=self.stats.round_failures,
            condition=condition,
            condition_detail=detail,
            ranks=[RankStatus.of(r) for r in w.rank_reports()],
            last_sync_miss=None if (miss := self.store.arrivals.last_miss) is None else SyncMiss.of(miss),
            round_progress=None
            if progress is None
            else RoundProgress(
                target_tokens=progress.target,
                swarm_tokens=round(progress.done),
                peers=progress.peers,
                own_tokens=trainer.round_tokens if trainer else 0,
            ),
        )

    def health(self) -> Health:
        """Serving, and the training thread alive: 503 once it has been inside inner steps with no
        step for --health-stall-s (the first step's one-off set-up counts as one)."""
        trainer = self.worker.trainer if self.worker.built else None
        if trainer is not None and trainer.running:
            idle = time.monotonic() - trainer.progress_at
            if idle > self.settings.operations.health_stall_s:
                return Health(
                    ok=False,
                    state=self.state.state,
                    detail=f"no inner step for {idle:.0f}s (--health-stall-s {self.settings.operations.health_stall_s:g})",
                )
        return Health(ok=True, state=self.state.state)

    def readiness(self) -> Health:
        """`/readyz`: in the swarm. Averaged with another peer in one of the last READY_ROUNDS
        rounds (a node alone, failing every round or still downloading is not), and not found
        unreachable by a peer's dial-back."""
        state = self.state.state
        recent = list(self.stats.recent)[-READY_ROUNDS:]
        if not any(o in (RoundOutcome.FULL, RoundOutcome.PARTIAL) for o in recent):
            why = (
                "no round finished yet"
                if not recent
                else f"averaged with no peer in its last {len(recent)} round(s) ({', '.join(o.value for o in recent)})"
            )
            return Health(ok=False, state=state, detail=why)
        found = self.reachability
        if found is not None and not found.ok:
            return Health(
                ok=False, state=state, detail=f"a peer could not reach it: {found.grpc_error or found.http_error}"
            )
        return Health(ok=True, state=state, detail=f"last round {recent[-1].value}")

    def _expected_bytes(self, group_size: int) -> int:
        if not self.worker.built:
            return 0
        s = self.settings
        return expected_payload_bytes(self.worker.replica.numel, max(group_size, 2), s.wire.wire_format())

    async def peer_records(self) -> list[dict[str, Any]]:
        """The swarm's records, with what a reader wants from them: seconds since each was
        last refreshed, and how many outer steps each is behind this node."""
        members = await self.membership.members()
        now, own = get_dht_time(), self.worker.outer_step
        return [
            r.model_dump() | {"last_seen_s": round(max(0.0, now - r.progress_at), 1), "lag": own - r.outer_step}
            for r in sorted(members.values(), key=lambda r: r.peer_id)
        ]

    def checkpoint(self, step: int | None = None) -> CheckpointInfo | None:
        return self.store.newest() if step is None else self.store.get(step)

    def memory_checkpoint(self, step: int) -> MemoryCheckpoint | None:
        return self.store.memory_checkpoint(step)

    async def current_checkpoint(self) -> CheckpointInfo | None:
        return await self.store.current(self.state.serving)
