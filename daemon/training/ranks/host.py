"""A host's local training ranks: the node process is local rank 0, the others are its children.

A GPU box is one peer of the swarm: one DHT identity, one group member, one sidecar. Inside it,
the node starts one training rank per selected GPU (`--gpus`; `--nproc-per-node` on a CPU,
over gloo, which is how tests and CI exercise it). The ranks are data-parallel replicas (DDP):
they hold the same θ_l, each takes its own rows of the node's batch, and DDP averages their
gradients, so a node with N ranks at batch B takes exactly the step of one rank at batch N·B.

Why rank 0 is the node process and talks to the swarm alone: with DDP every rank holds the
same full θ_l, so the wire gains nothing from several senders (the bytes are the host's one
Δ either way), while one sender keeps one identity, one TLS certificate and one set of gRPC
streams per host, and a host's bytes per round equal a one-device node's exactly. What the
ranks would share is the int8 quantisation, which is vectorised and runs at GB/s, far above
any wide-area link.

Rank 0 drives the others over a gloo control group, one small header per command:
- STEP: the learning rate and this step's rows of the node's batch (rank 0 draws the batch
  from the node's one data stream, so the data position is the node's, whatever the rank
  count, and each rank reads a disjoint part of it); every rank reports its loss, step time
  and memory back (`RankReport`);
- PARAMS: θ_l from rank 0 (after an outer step, a landing, a load or a reset: whatever
  changed it outside an inner step);
- INNER: rank 0's AdamW state (after a resume or a reset, and to restarted ranks).
The children are started with the parent's death signal set, ignore SIGINT and SIGTERM
(the node stops them once its last round is over) and are killed, never asked, at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from enum import IntEnum
from typing import Protocol

import torch
import torch.distributed as dist
from pydantic import BaseModel

from dtnode.daemon.config.settings import NodeSettings, SettingsError
from dtnode.daemon.workload.build import resolve_device
from dtnode.peers.dht_start import free_port
from dtnode.peers.forks import popen

log = logging.getLogger("dtnode")

SPEC_ENV = "DTNODE_LOCAL_RANK_SPEC"
OOM_EXIT = 75  # a child's exit code after a CUDA out-of-memory error (its one line is on stdout)
CONTROL_TIMEOUT = timedelta(days=7)  # children wait for the next command through whole rounds
KILL_WAIT_S = 10.0


class Command(IntEnum):
    STEP = 1
    PARAMS = 2
    INNER = 3
    GATHER = 4  # --shard: every rank's shards of θ_l to rank 0
    GATHER_INNER = 5  # --shard: every rank's shards of the AdamW moments to rank 0
    EVAL = 6  # --shard: the held-out loss, every rank running the forward passes
    ADD = 7  # --shard: an amount added to θ_l, parameter by parameter, from rank 0


class RankState(IntEnum):
    STARTING = 0
    TRAINING = 1
    IDLE = 2
    FAILED = 3


@dataclass(frozen=True)
class RankPlan:
    """Which devices the node's ranks train on (rank r on devices[r]) and how they talk."""

    devices: tuple[torch.device, ...]
    threads: int | None  # torch threads per rank; None: torch's own

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def backend(self) -> str:
        return "nccl" if self.devices[0].type == "cuda" else "gloo"


def plan_ranks(s: NodeSettings) -> RankPlan:
    """The ranks `--device`, `--gpus` and `--nproc-per-node` ask for, checked against the host."""
    device = resolve_device(s.hardware.device)
    count = s.hardware.nproc_per_node
    if device.type == "cuda" and device.index is None:
        devices = [torch.device("cuda", i) for i in selected_gpus(s.hardware.gpus, torch.cuda.device_count())]
        if count is not None:
            if count > len(devices):
                raise SettingsError("--nproc-per-node", f"{count} ranks asked, but --gpus selects {len(devices)} GPUs")
            devices = devices[:count]
    elif device.type == "cpu":
        devices = [device] * (count or 1)
    else:  # cuda:N or mps: that one device (the settings refuse several ranks on it)
        devices = [device]
    threads = s.hardware.threads_per_rank
    if threads is None and len(devices) > 1 and device.type == "cpu":
        threads = max(1, (os.cpu_count() or 1) // len(devices))
    return RankPlan(tuple(devices), threads)


def selected_gpus(spec: str, available: int) -> list[int]:
    """`--gpus`: all, or indices ("0", "0,3,5"; a trailing comma as in "3," is allowed)."""
    if spec == "all":
        return list(range(available))
    indices = [int(part) for part in spec.split(",") if part]
    if len(set(indices)) != len(indices):
        raise SettingsError("--gpus", f"{spec!r} names a GPU twice")
    missing = [i for i in indices if i >= available]
    if missing:
        raise SettingsError("--gpus", f"no GPU {missing[0]} on this host (it has {available}: 0 to {available - 1})")
    return indices


class RankSpec(BaseModel):
    """What a child rank needs to build its replica (passed in its environment as JSON)."""

    rank: int
    world_size: int
    port: int
    backend: str
    device: str
    model: str
    compile: bool
    grad_clip: float
    weight_decay: float
    inner_optimizer: str = "adamw"  # --inner-optimizer (an InnerOptimizerKind's value)
    threads: int | None
    shard: bool
    parent_pid: int
    timeout_s: float
    precision: str = "auto"  # --precision, resolved by each rank for its own device


@dataclass
class RankReport:
    """One rank as /status and /metrics show it."""

    rank: int
    device: str
    state: RankState = RankState.STARTING
    pid: int = 0
    step_seconds: float = 0.0
    tokens_per_s: float = 0.0
    memory_bytes: int = 0  # resident memory of the rank's process
    device_memory_bytes: int = 0  # peak memory allocated on its GPU (0 on a CPU)
    restarts: int = 0


class LocalRankFailure(RuntimeError):
    """A child rank died or a collective with it broke: the host restarts its ranks."""


class HostRestartNeeded(RuntimeError):
    """A rank failed where the ranks cannot be restarted in place (--shard): the node exits
    with code 1 and one line, and its supervisor starts it again from its newest checkpoint."""


class RankOutOfMemory(SettingsError):
    """A rank ran out of device memory: restarting would only repeat it, so the node stops."""

    def __init__(self, message: str):
        super().__init__("--batch-size", message)


@dataclass
class LocalRanks:
    """Rank 0's side: starts the children, joins the process group, drives every step."""

    plan: RankPlan
    settings: NodeSettings
    collective_timeout_s: float = 300.0
    reports: list[RankReport] = field(default_factory=list)
    _children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _control: dist.ProcessGroup | None = None
    restarts: int = 0

    def __post_init__(self) -> None:
        self.reports = [RankReport(r, str(d)) for r, d in enumerate(self.plan.devices)]

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def running(self) -> bool:
        return self._control is not None

    @property
    def shard(self) -> bool:
        return self.settings.hardware.shard

    @property
    def device(self) -> torch.device:
        return self.plan.devices[0]

    @property
    def control(self) -> dist.ProcessGroup:
        assert self._control is not None
        return self._control

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn ranks 1..N-1 and form the process group with them (blocks until they joined)."""
        port = free_port("127.0.0.1")
        for rank in range(1, self.world_size):
            spec = RankSpec(
                rank=rank,
                world_size=self.world_size,
                port=port,
                backend=self.plan.backend,
                device=str(self.plan.devices[rank]),
                model=self.settings.workload.model,
                compile=self.settings.hardware.compile,
                grad_clip=self.settings.inner.grad_clip,
                weight_decay=self.settings.inner.inner_weight_decay,
                inner_optimizer=self.settings.inner.inner_optimizer.value,
                threads=self.plan.threads,
                shard=self.shard,
                precision=self.settings.hardware.precision,
                parent_pid=os.getpid(),
                timeout_s=self.collective_timeout_s,
            )
            env = {**os.environ, SPEC_ENV: spec.model_dump_json()}
            child = popen(  # not while the DHT forks: it would keep this Popen's pipes (forks.py)
                [sys.executable, "-m", "dtnode.daemon.training.ranks.child"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
            )
            self._children.append(child)
            self.reports[rank].pid, self.reports[rank].state = child.pid, RankState.STARTING
        self.reports[0].pid = os.getpid()
        try:
            dist.init_process_group(
                self.plan.backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=self.world_size,
                timeout=timedelta(seconds=self.collective_timeout_s),
                device_id=self.plan.devices[0] if self.plan.backend == "nccl" else None,
            )
            self._control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        except (RuntimeError, ValueError, OSError) as e:  # a child that died, a port taken since
            why = self.failure() or str(e)
            self.stop()
            raise LocalRankFailure(f"the local ranks did not start: {why}") from None
        for report in self.reports:
            report.state = RankState.IDLE
        log.info(
            "%d local ranks on %s (%s)",
            self.world_size,
            ", ".join(str(d) for d in self.plan.devices),
            self.plan.backend,
        )

    def stop(self) -> None:
        """Kill the children and leave the process group (a stopping node's, or a restart's)."""
        for child in self._children:
            if child.poll() is None:
                child.kill()
        for child in self._children:
            try:
                child.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("local rank pid %d did not exit after SIGKILL", child.pid)
            if child.stdout is not None:
                child.stdout.close()
        self._children = []
        if dist.is_initialized():
            dist.destroy_process_group()
        self._control = None

    def restart(self) -> None:
        """After a rank's failure: every child anew, from the state rank 0 then sends them."""
        self.restarts += 1
        for report in self.reports[1:]:
            report.restarts += 1
        self.stop()
        self.start()

    def failure(self) -> str | None:
        """What went wrong with a child, if one has exited (raises RankOutOfMemory for an OOM)."""
        deadline = time.monotonic() + 1.0  # a collective may see the broken socket before wait() sees the exit
        while self._children:
            for rank, child in enumerate(self._children, start=1):
                code = child.poll()
                if code is None:
                    continue
                self.reports[rank].state = RankState.FAILED
                said = child.stdout.read().decode(errors="replace").strip() if child.stdout is not None else ""
                if code == OOM_EXIT:
                    raise RankOutOfMemory(said or f"local rank {rank} ran out of device memory")
                how = f"signal {-code}" if code < 0 else f"code {code}"
                return f"local rank {rank} ({self.plan.devices[rank]}) exited with {how}"
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._children[0].wait(min(0.05, left))
        return None

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Around work with the children (a command and its collectives): an error raised
        because a child died (gloo's broken socket, NCCL's abort) becomes LocalRankFailure,
        naming the rank, so the round loop restarts the ranks (or, under --shard, the node)."""
        try:
            yield
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, OSError) as e:
            if isinstance(e, LocalRankFailure) or (why := self.failure()) is None:
                raise
            raise LocalRankFailure(why) from e

    # ---- commands (training thread) ----------------------------------------------------------
    def command(self, command: Command, *values: float) -> None:
        """Tell every child what comes next (what follows is the collective it names)."""
        header = torch.zeros(4, dtype=torch.float64)
        header[0] = float(command)
        for i, value in enumerate(values, start=1):
            header[i] = value
        dist.broadcast(header, 0, group=self._control)

    def send_params(self, flat: torch.Tensor) -> None:
        """θ_l (rank 0's flat buffer) to every rank."""
        self.command(Command.PARAMS)
        dist.broadcast(flat, 0)

    def send_inner(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: int) -> None:
        """Rank 0's AdamW moments (flat, parameter order) and step count; steps 0: fresh."""
        self.command(Command.INNER, float(steps))
        if steps > 0:
            device = self.plan.devices[0]
            for moments in (exp_avg, exp_avg_sq):
                buffer = moments.to(device) if self.plan.backend == "nccl" else moments.contiguous()
                dist.broadcast(buffer, 0)

    def send_step(self, lr: float, batch: torch.Tensor) -> torch.Tensor:
        """Start an inner step on every rank: its rows of the node's batch; rank 0's rows returned."""
        rows = batch.shape[0] // self.world_size
        self.command(Command.STEP, lr, float(rows), float(batch.shape[1]))
        parts = list(batch.split(rows))
        own = torch.empty_like(parts[0])
        dist.scatter(own, [p.contiguous() for p in parts], src=0, group=self._control)
        for report in self.reports:
            report.state = RankState.TRAINING
        return own

    def collect(self, loss: float, step_seconds: float, tokens_per_rank: int) -> float:
        """After a step: every rank's loss, step time and memory; the mean loss over the ranks."""
        own = torch.tensor([loss, step_seconds, *own_memory(self.plan.devices[0])], dtype=torch.float64)
        gathered = [torch.empty(4, dtype=torch.float64) for _ in range(self.world_size)]
        dist.gather(own, gathered, dst=0, group=self._control)
        for report, values in zip(self.reports, gathered):
            report.state = RankState.IDLE
            report.step_seconds = float(values[1])
            report.tokens_per_s = tokens_per_rank / report.step_seconds if report.step_seconds > 0 else 0.0
            report.memory_bytes, report.device_memory_bytes = int(values[2]), int(values[3])
        return float(torch.stack([g[0] for g in gathered]).mean())


class RankSync(Protocol):
    """How rank 0 keeps the other local ranks' replicas in step with its θ_l and its
    AdamW state: `ddp.ReplicatedRanks` (DDP, every rank holds everything) or, with --shard,
    `fsdp.HostShards`. The trainer calls these on its thread, between inner steps."""

    evaluates_together: bool  # the held-out eval runs on every rank (its forward passes are collectives)

    def push_params(self) -> None:
        """θ_l that rank 0 holds and the ranks do not yet (changed outside an inner step) to every rank."""

    def push_inner(self, optimizer: torch.optim.Optimizer) -> None:
        """The AdamW state loaded last (or rank 0's own) to every rank."""

    def gather_inner(self, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The node's AdamW moments, flat in parameter order, and the step count."""
        ...

    def load_inner(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, moments: FlatMoments) -> None:
        """Take these moments as the node's (sent to the ranks by the next `push_inner`)."""

    def eval_tokens(self, eval_set: torch.Tensor) -> torch.Tensor:
        """The tokens rank 0 evaluates (telling the ranks to evaluate them too, if together)."""
        ...


FlatMoments = tuple[torch.Tensor, torch.Tensor, int]


def own_memory(device: torch.device) -> tuple[float, float]:
    """This process's resident memory and, on a GPU, its peak allocation there (bytes)."""
    import psutil

    rss = float(psutil.Process().memory_info().rss)
    peak = float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0
    return rss, peak


def out_of_memory_line(rank: int, device: torch.device | str, e: BaseException) -> str:
    """The one line a rank's CUDA out-of-memory error ends the node with."""
    found = re.search(r"Tried to allocate ([\d.]+ ?[KMGT]?i?B)", str(e))
    asked = found.group(1) if found else "an unknown amount"
    return (
        f"local rank {rank} on {device} ran out of GPU memory (it asked for {asked}); "
        "use a smaller --batch-size, or more GPUs"
    )


def die_with_parent(parent_pid: int) -> None:
    """A child rank dies with the node, even after a kill -9 of the node (Linux: PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was set
        os._exit(1)
