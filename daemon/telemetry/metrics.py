"""The node's Prometheus families, in one registry served at /metrics.

Names follow Prometheus conventions (counters end in `_total`, durations in `_seconds`,
sizes in `_bytes`), and every labelled family starts with the labels an alert rule keys on
already present at zero, so `rate(...)` and `increase(...)` work from the first scrape
instead of only after the first failure.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

import psutil
import torch
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from dtnode.peers.dht_requests import REQUESTS as DHT_REQUESTS
from dtnode.peers.dht_unanswered import UNANSWERED as DHT_UNANSWERED


class RankFigures(Protocol):
    """What a local rank reports into the metrics (training/ranks/host.py's RankReport)."""

    rank: int
    device: str
    tokens_per_s: float
    memory_bytes: int
    device_memory_bytes: int


ROUND_OUTCOMES = ("full", "partial", "alone", "failed")
NODE_STATES = ("joining", "syncing", "training", "averaging", "stopped")
PHASES = ("inner", "matchmaking", "allreduce", "waiting", "eval", "outer")
# how a part or hop fails: gRPC status codes seen by the client, and the data plane's own errors
COMMON_FAILURES = (
    "deadline_exceeded",
    "unavailable",
    "chunkerror",
    "timeouterror",
    "incomplete_group",
    "dropped_sender",
)


def watch_state_dir(metrics: NodeMetrics, path: Path) -> None:
    """Free disk, read at each scrape."""

    def free() -> float:
        try:
            return float(shutil.disk_usage(path).free)
        except OSError:
            return math.nan

    metrics.state_dir_free.set_function(free)


def watch_feedback(metrics: NodeMetrics, norm: Callable[[], float | None]) -> None:
    """The error-feedback buffer's norm, read at each scrape: what a node restored from its
    checkpoint shows before its first round, and each outer step's after it."""

    def read() -> float:
        value = norm()
        return math.nan if value is None else value

    metrics.feedback_norm.set_function(read)


def observe_device_memory(metrics: NodeMetrics, device: torch.device) -> None:
    """The training device's memory now (called at each round's end)."""
    if device.type == "cuda":
        metrics.device_memory.labels(device=str(device), kind="allocated").set(torch.cuda.memory_allocated(device))
        metrics.device_memory.labels(device=str(device), kind="reserved").set(torch.cuda.memory_reserved(device))
    else:
        metrics.device_memory.labels(device=str(device), kind="resident").set(psutil.Process().memory_info().rss)


def observe_ranks(metrics: NodeMetrics, reports: Iterable[RankFigures]) -> None:
    """Every local rank's throughput and memory (called at each round's end)."""
    for report in reports:
        labels = (str(report.rank), report.device)
        metrics.rank_tokens_per_second.labels(*labels).set(report.tokens_per_s)
        metrics.rank_memory.labels(*labels, "resident").set(report.memory_bytes)
        metrics.rank_memory.labels(*labels, "device_peak").set(report.device_memory_bytes)


def failure_reason(error: str) -> str:
    """The label of a failed part: the code before the colon of its error, lower case, bounded."""
    code = error.split(":", 1)[0].strip().lower() or "unknown"
    return "".join(c for c in code if c.isalnum() or c == "_")[:40] or "unknown"


class CountsCollector(Collector):
    """A counter family read from a lower layer's plain counts at each scrape (the data plane
    keeps `Counter`s of its own and imports nothing of the daemon's), keyed by one label's value
    or by a tuple of values, one per label: `dtnode_refused_streams_total{reason}`, streams this
    node's reducer refused for what they carried; `dtnode_dht_requests_total{op,key}`, the DHT
    reads and writes this node made, by the kind of key; `dtnode_dht_unanswered_total{call}`, its
    requests to other DHT peers that went unanswered."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: str | tuple[str, ...],
        counts: Mapping[str, int] | Mapping[tuple[str, ...], int],
    ):
        self.name, self.documentation, self.counts = name, documentation, counts
        self.labels = (labels,) if isinstance(labels, str) else labels

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=list(self.labels))
        for values, count in sorted(self.counts.items()):
            family.add_metric([values] if isinstance(values, str) else list(values), count)
        yield family


class NodeMetrics:
    """What an operator scrapes and alerts on: progress, round health, traffic, checkpoints, peers."""

    def __init__(self, version: str, run_id: str, model: str, device: str):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        Info("dtnode_build", "This node's version, run and model", registry=r).info(
            {"version": version, "run_id": run_id, "model": model, "device": device}
        )
        self._progress_families(r)
        self._wire_families(r)
        self._round_families(r)
        self._checkpoint_families(r)
        self._device_families(r)
        self._membership_families(r)
        r.register(
            CountsCollector(
                "dtnode_dht_requests",
                "DHT reads (get) and writes (store) this node made, by the kind of key (membership, registrations, closed, formed and declined member lists)",
                ("op", "key"),
                DHT_REQUESTS,
            )
        )
        r.register(
            CountsCollector(
                "dtnode_dht_unanswered",
                "DHT requests to another peer (a search's find, a write's store) that got no answer: the peer paused, gone, or slower than hivemind's 3 s request timeout",
                "call",
                DHT_UNANSWERED,
            )
        )
        self.swarm_health_gauges(r)
        for outcome in ROUND_OUTCOMES:
            self.rounds.labels(outcome=outcome)
        for reason in COMMON_FAILURES:
            self.hop_failures.labels(reason=reason)
        for reason in ("asked", "diverged"):  # present at zero too, for rate()
            self.theta_resyncs.labels(reason=reason)
        for kind in ("mean", "momentum"):
            self.bounded_updates.labels(kind=kind)
        for phase in PHASES:
            self.phase_seconds.labels(phase=phase)

    def _progress_families(self, r: CollectorRegistry) -> None:
        """Where training stands: state, steps, loss, throughput, utilization, group size."""
        self.state = Enum("dtnode_state", "The node's state (as /status.state)", states=list(NODE_STATES), registry=r)
        self.outer_step = Gauge("dtnode_outer_step", "Completed outer steps (θ_g's step)", registry=r)
        self.inner_step = Gauge("dtnode_inner_step", "Inner steps taken by this node", registry=r)
        self.loss = Gauge("dtnode_loss", "Mean inner training loss of the last round", registry=r)
        self.eval_loss = Gauge("dtnode_eval_loss", "Held-out loss of θ_g (the same on every peer)", registry=r)
        self.tokens_per_second = Gauge("dtnode_tokens_per_second", "Training throughput of the last round", registry=r)
        self.tokens = Counter("dtnode_tokens", "Tokens this node trained on", registry=r)
        self.compute_utilization = Gauge(
            "dtnode_compute_utilization_ratio",
            "Fraction of wall time since the first round spent in inner steps",
            registry=r,
        )
        self.group_size = Gauge("dtnode_group_size", "Size of the last round's first averaging group", registry=r)

    def _wire_families(self, r: CollectorRegistry) -> None:
        """What this node sends: bytes per parameter, the code's density, what error feedback holds."""
        self.wire_bytes_per_param = Gauge(
            "dtnode_wire_bytes_per_param",
            "Bytes this node sent in the last round per parameter of Δ, by --compression",
            ["compression"],
            registry=r,
        )
        self.wire_density = Gauge(
            "dtnode_wire_density", "Share of Δ's values a sender puts on the wire (sparse: top-k / block)", registry=r
        )
        self.feedback_norm = Gauge(
            "dtnode_error_feedback_norm",
            "L2 norm of what this node's code has not sent yet (NaN: none kept)",
            registry=r,
        )

    def _round_families(self, r: CollectorRegistry) -> None:
        """How rounds end and how long they and their phases take; retries and θ_g re-syncs."""
        self.rounds = Counter(
            "dtnode_rounds",
            "Outer rounds ended, by outcome (full: every group whole; "
            "partial: a group lacked a member or a part failed; alone: no "
            "group; failed: the round raised)",
            ["outcome"],
            registry=r,
        )
        self.round_failures = Counter(
            "dtnode_round_failures", "Rounds ended by an exception, by its type", ["reason"], registry=r
        )
        self.hop_failures = Counter(
            "dtnode_hop_failures",
            "Failed parts, incomplete groups and groups whose mean lacked a member in some part "
            "(dropped_sender), of averaging hops, by reason",
            ["reason"],
            registry=r,
        )
        self.stream_retries = Counter(
            "dtnode_stream_retries",
            "Streams to a reducer that broke before any result "
            "came back (a reset, or bytes altered on the path), "
            "or that found the group not formed there yet (failed_precondition), "
            "and were sent again, by error",
            ["reason"],
            registry=r,
        )
        self.theta_resyncs = Counter(
            "dtnode_theta_resyncs",
            "Hops whose group also averaged θ_g: asked (after a failure, a download, on schedule) "
            "or diverged (no member asked, but their θ_g hashes differed)",
            ["reason"],
            registry=r,
        )
        self.bounded_updates = Counter(
            "dtnode_bounded_updates",
            "Outer steps whose averaged Δ (kind=mean) or outer momentum (kind=momentum) this node "
            "scaled down to its bound of its own recent Δ: now and then, a round it trained far "
            "less than its group; round after round, a member steering the swarm",
            ["kind"],
            registry=r,
        )
        self.allreduce_sent = Counter("dtnode_allreduce_sent_bytes", "Payload bytes sent by all-reduces", registry=r)
        self.allreduce_received = Counter(
            "dtnode_allreduce_received_bytes", "Payload bytes received by all-reduces", registry=r
        )
        self.last_round_at = Gauge(
            "dtnode_last_round_timestamp_seconds",
            "Unix time the last round ended (an alert on no progress keys on it)",
            registry=r,
        )
        self.round_seconds = Histogram(
            "dtnode_round_seconds",
            "Wall time of an outer round",
            registry=r,
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
        )
        self.phase_seconds = Histogram(
            "dtnode_round_phase_seconds",
            "Wall time of each phase of a round",
            ["phase"],
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
        )
        self.allreduce_seconds = Histogram(
            "dtnode_allreduce_seconds",
            "Wall time of one hop's data plane",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
        )

    def _checkpoint_families(self, r: CollectorRegistry) -> None:
        """Checkpoints written, served and downloaded, and the room left for them."""
        self.checkpoint_write_seconds = Histogram(
            "dtnode_checkpoint_write_seconds",
            "Time to write a checkpoint",
            registry=r,
            buckets=(0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
        )
        self.checkpoint_served = Counter(
            "dtnode_checkpoint_served_bytes", "Checkpoint bytes served to joiners", registry=r
        )
        self.checkpoint_downloaded = Counter(
            "dtnode_checkpoint_downloaded_bytes", "Checkpoint bytes this node downloaded from its peers", registry=r
        )
        self.checkpoint_write_failures = Counter(
            "dtnode_checkpoint_write_failures",
            "Checkpoint writes that failed (a full disk, a read-only state dir)",
            registry=r,
        )
        self.checkpoint_newest_step = Gauge(
            "dtnode_checkpoint_newest_step",
            "Outer step of the newest checkpoint in the state dir (-1: none)",
            registry=r,
        )
        self.checkpoint_newest_step.set(-1)
        self.state_dir_free = Gauge(
            "dtnode_state_dir_free_bytes", "Free space on the state dir's disk (checkpoints need room)", registry=r
        )

    def _device_families(self, r: CollectorRegistry) -> None:
        """Memory and throughput of the device and of each local rank."""
        self.device_memory = Gauge(
            "dtnode_device_memory_bytes",
            "Memory of the training device: allocated and reserved by torch on a GPU, resident on a CPU",
            ["device", "kind"],
            registry=r,
        )
        self.rank_tokens_per_second = Gauge(
            "dtnode_rank_tokens_per_second",
            "Tokens per second of each local training rank (its rows of the node's batch, last step)",
            ["rank", "device"],
            registry=r,
        )
        self.rank_memory = Gauge(
            "dtnode_rank_memory_bytes",
            "Memory of each local training rank: resident (its process) and device_peak (its GPU)",
            ["rank", "device", "kind"],
            registry=r,
        )
        self.rank_restarts = Counter(
            "dtnode_local_rank_restarts", "Restarts of this host's local ranks after one of them failed", registry=r
        )

    def _membership_families(self, r: CollectorRegistry) -> None:
        """Catch-ups, a joiner's dropped steps, and the peers seen."""
        self.catchups = Counter("dtnode_catchups", "Downloads of the swarm's state to join or catch up", registry=r)
        self.checkpoint_skips = Counter(
            "dtnode_checkpoint_skips",
            "Donors or files a download of the swarm's state passed over, by why (checkpoints/arrivals.py `Skip`: no_offer, "
            "unannounced, no_majority, contradicted, not_yet, failed, refused; each present at zero once the "
            "node runs)",
            ["why"],
            registry=r,
        )
        self.dropped_inner_steps = Counter(
            "dtnode_dropped_inner_steps",
            "Inner steps of a joiner's first round that the swarm averaged without it before they were done: "
            "their Δ was dropped for the swarm's next θ_g (in dtnode_inner_step, not in dtnode_tokens_total)",
            registry=r,
        )
        self.peers_live = Gauge(
            "dtnode_peers_live", "Peers with a live record in the swarm, this node included", registry=r
        )
        self.peers_seen = Gauge(
            "dtnode_peers_seen", "Distinct peers this node has seen since it started, this node included", registry=r
        )

    def swarm_health_gauges(self, r: CollectorRegistry) -> None:
        """What deploy/prometheus/alerts.yml keys on beyond rounds: memory against the host's,
        reachability, and agreement on θ_g with the peers at this node's step."""
        self.host_memory = Gauge(
            "dtnode_host_memory_bytes", "Total memory of this host (for process_resident_memory_bytes)", registry=r
        )
        self.host_memory.set(psutil.virtual_memory().total)
        self.reachable = Gauge(
            "dtnode_reachable",
            "1: a peer's dial-back reached this node's announced addresses; 0: it could not; -1: not checked "
            "yet (no live peer to ask, or client mode)",
            registry=r,
        )
        self.reachable.set(-1)
        self.theta_agreement = Gauge(
            "dtnode_theta_agreement_ratio",
            "Share of the live peers at this node's outer step, itself included, whose θ_g hash is this node's "
            "(NaN: its hash is not known yet)",
            registry=r,
        )
        self.theta_agreement.set(math.nan)
