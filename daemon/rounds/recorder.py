"""A finished round into everything that reports it: `/status`, the metrics, the history
(`/history`, history.jsonl) and the log line, the last two once the round's θ_g hash is in.

The round loop (loop.py) hands each round here once its outer step is taken.
"""

from __future__ import annotations

import asyncio
import logging

from dtnode.daemon.checkpoints.store import CheckpointStore
from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.records.history import RoundHistory
from dtnode.daemon.records.report import RoundSummary, RunStats, WireStats
from dtnode.daemon.records.state import Publisher
from dtnode.daemon.rounds.landing import Landing
from dtnode.daemon.telemetry.metrics import NodeMetrics, observe_device_memory, observe_ranks
from dtnode.daemon.training.trainer import InnerResult
from dtnode.daemon.training.worker import ModelWorker
from dtnode.peers.averager import AveragingResult

log = logging.getLogger("dtnode")


class RoundRecorder:
    """Records each round of one node; keeps the token count over the whole record."""

    def __init__(
        self,
        settings: NodeSettings,
        peer_id: str,
        worker: ModelWorker,
        store: CheckpointStore,
        landing: Landing,
        publisher: Publisher,
        stats: RunStats,
        metrics: NodeMetrics,
        history: RoundHistory,
        loss_floor: float | None,
    ):
        self.settings = settings
        self.peer_id = peer_id
        self.worker = worker
        self.store = store
        self.landing = landing
        self.publisher = publisher
        self.stats = stats
        self.metrics = metrics
        self.history = history
        self.loss_floor = loss_floor
        self.tokens_total = history.tokens_total  # over the whole record, across restarts
        self._bounded_seen = (0, 0)  # the replica's scaled means and momenta, as last counted

    def _wire_stats(self) -> WireStats:
        s, worker = self.settings, self.worker
        wire = s.wire.wire_format()
        density = min(wire.top_k, wire.block_size) / wire.block_size if s.wire.compression == "sparse" else 1.0
        return WireStats(s.wire.compression, worker.replica.numel, density, worker.feedback_norm)

    def _newly_bounded(self) -> dict[str, int]:
        """How many averaged Δ ("mean") and momenta ("momentum") the replica scaled down since
        the last round was recorded."""
        bounds = self.worker.replica.bounds
        now = (bounds.outer_steps_scaled, bounds.momenta_scaled)
        seen, self._bounded_seen = self._bounded_seen, now
        return {"mean": now[0] - seen[0], "momentum": now[1] - seen[1]}

    def finish(
        self,
        round_no: int,
        inner: InnerResult,
        result: AveragingResult | None,
        duration: float,
        landed_after: int | None = None,
    ) -> RoundSummary:
        """The round into `/status`, the metrics, the history and the log."""
        trainer = self.worker.trainer
        bounded = self._newly_bounded()
        summary = RoundSummary(
            round_no,
            self.worker.outer_step,
            inner,
            result,
            duration,
            self.landing.take_waited(),
            trainer.eval_seconds,
            self.settings.diloco.overlap,
            self.worker.eval_loss,
            self.worker.eval_step,
            trainer.lr,
            landed_after,
            self.peer_id,
            self._wire_stats(),
            tuple(kind for kind, count in bounded.items() if count),
            self.store.arrivals.take(),
        )
        trainer.eval_seconds = 0.0
        self.stats.last = summary
        self.stats.round_ended(summary.outcome)
        m = self.metrics
        summary.observe(m)
        m.outer_step.set(self.worker.outer_step)
        m.inner_step.set(trainer.inner_step)
        m.tokens_per_second.set(self.stats.tokens_per_s)
        m.compute_utilization.set(self.stats.utilization() or 0.0)
        observe_device_memory(m, self.worker.device)
        observe_ranks(m, self.worker.rank_reports())
        for kind, count in bounded.items():
            m.bounded_updates.labels(kind=kind).inc(count)
        self.tokens_total += inner.tokens
        entry = summary.history_entry(self.tokens_total, self.stats.tokens_per_s)
        line = summary.log_line(self.stats.tokens_per_s, self.loss_floor)
        loop = asyncio.get_running_loop()

        def hashed() -> None:  # the round's θ_g hash is in: the history entry and the log line name it
            params = self.worker.replica.params_sha256()
            recorded = self.history.append({**entry, "params_sha256": params})
            loop.run_in_executor(self.store.io_thread, self.history.persist, recorded)
            log.info("%s%s", line, params[:12])
            # the step's checkpoint is servable now: its signed record says so at once, not a
            # heartbeat later (a joiner's vote binds only what a record announces, daemon/catchup/donors.py)
            self.publisher.publish()

        self.store.when_hashed(hashed)
        return summary
