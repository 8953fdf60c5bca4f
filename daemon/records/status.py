"""`GET /status` and the probes, as typed records: what a node's operator, scripts and peers
read of it. Built by the presenter (serve/presenter.py) from the round records of report.py.
"""

from __future__ import annotations

from dataclasses import asdict

from pydantic import BaseModel, field_validator

from dtnode.daemon.checkpoints.arrivals import FetchMiss, Skip, passed_over_entries
from dtnode.daemon.records.history import finite_or_none
from dtnode.daemon.records.report import Condition, LastRound
from dtnode.daemon.records.state import NodeState
from dtnode.daemon.swarm.reachability import Reachability
from dtnode.daemon.training.ranks.host import RankReport
from dtnode.daemon.workload.recipe import SwarmRecipe


class Health(BaseModel):
    """`GET /healthz`: 200 while `ok`, 503 otherwise, with the reason."""

    ok: bool
    state: NodeState
    detail: str = ""


class RankStatus(BaseModel):
    """One local training rank of this host (rank 0 is the node process itself)."""

    rank: int
    device: str
    state: str  # starting, training, idle or failed
    pid: int
    tokens_per_s: float  # this rank's rows of the node's batch, over its last step's time
    step_seconds: float
    memory_bytes: int  # resident memory of its process
    device_memory_bytes: int  # its peak allocation on its GPU (0 on a CPU)
    restarts: int  # times the host restarted it after a rank failed

    @classmethod
    def of(cls, report: RankReport) -> RankStatus:
        return cls(**{**asdict(report), "state": report.state.name.lower()})


class RoundProgress(BaseModel):
    target_tokens: int
    swarm_tokens: int
    peers: int
    own_tokens: int


class PassedOver(BaseModel):
    """A donor or file a fetch of the swarm's state left out (checkpoints/arrivals.py `Skip`)."""

    why: Skip
    peers: list[str]
    step: int | None  # None: a donor that offered no usable file
    detail: str


class SyncMiss(BaseModel):
    """The last fetch of the swarm's state that installed nothing, until a θ_g arrives: the
    steps it asked for, when (wall time), and what it passed over and why."""

    first_step: int
    last_step: int
    time: float
    passed_over: list[PassedOver]

    @classmethod
    def of(cls, miss: FetchMiss) -> SyncMiss:
        return cls(
            first_step=miss.first_step,
            last_step=miss.last_step,
            time=miss.at,
            passed_over=[PassedOver(**entry) for entry in passed_over_entries(miss.passed_over)],
        )


class NodeStatus(BaseModel):
    """`GET /status`: this node as its operator and scripts see it (ARCHITECTURE.md lists the
    fields other tools depend on)."""

    peer_id: str
    run_id: str
    state: NodeState
    phase: str
    outer_step: int
    inner_step: int
    inner_lr: float | None
    loss: float | None
    eval_loss: float | None
    eval_step: int | None
    loss_floor: float | None
    tokens_per_s: float
    compute_utilization: float | None
    uptime_s: float
    params_sha256: str
    http_url: str
    grpc_addr: str
    join_command: str
    dht_addrs: list[str]
    tls_fingerprint: str | None
    model: str
    model_hash: str
    recipe: SwarmRecipe  # what a peer must share with this swarm; `join --peer http://` takes it from here
    max_rounds: int | None = None  # the outer step the run ends at (--max-rounds); a sidecar joiner takes it too
    device: str
    client_mode: bool
    reachability: Reachability | None = None  # a peer's dial-back of this node's announced addresses; None: not yet
    version: str
    last_round: LastRound | None
    deadlines: dict[str, float]
    fused_kernels: bool
    pacing: str
    round_failures: int
    condition: Condition
    condition_detail: str
    round_progress: RoundProgress | None
    ranks: list[RankStatus]  # this host's local training ranks, rank 0 first
    last_sync_miss: SyncMiss | None = None  # the last fetch of the swarm's state that found nothing to install

    @field_validator("loss", "eval_loss")
    @classmethod
    def _known(cls, value: float | None) -> float | None:
        return finite_or_none(value)
