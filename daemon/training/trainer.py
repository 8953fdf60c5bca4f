"""The inner loop: AdamW steps on the local weights θ_l, run on a worker thread.

The trainer owns the model and the inner optimizer; each replica keeps its own AdamW state
(DiLoCo. Averaging both moments every outer step would triple the traffic; in the reference
DiLoCo it gained about 1.3% at 4M tokens, no more than a change of seed moves:
docs/results/training-quality.md). It runs a bounded number of
steps per call and, between steps, checks a stop flag and asks the round's pacer whether
another step still fits before the swarm's round ends, so a shutdown never waits for a
whole round of compute and a slow peer never makes the swarm wait for a step it could not
finish in time. The tokens of a step not taken stay in the data stream for the next round.
Tests slow its steps down through the hooks of training/step_delays.py.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dtnode.daemon.training.inner_optimizer import InnerOptimizerKind
from dtnode.daemon.training.inner_state import flat_moments, install_inner_state, ordered_parameters
from dtnode.daemon.training.inner_step import held_out_loss, inner_step, learned_buffers
from dtnode.daemon.training.optimizer_build import OptimizerBuild
from dtnode.daemon.training.precision import Precision, StepPrecision
from dtnode.daemon.training.ranks.ddp import ReplicatedRanks
from dtnode.daemon.training.ranks.fsdp import HostShards
from dtnode.daemon.training.ranks.host import (
    HostRestartNeeded,
    LocalRankFailure,
    LocalRanks,
    RankOutOfMemory,
    RankSync,
    out_of_memory_line,
)
from dtnode.daemon.training.schedule import LearningRateSchedule
from dtnode.daemon.training.step_delays import StepDelays
from dtnode.daemon.training.theta_local import FlatLocal, LocalWeights
from dtnode.daemon.workload.data import DataStream
from dtnode.ops.flat import FlatParameters
from dtnode.peers import failpoints


@dataclass
class InnerResult:
    steps: int
    tokens: int
    mean_loss: float
    seconds: float
    mean_lr: float  # the mean inner learning rate of the steps taken (0.0 without a step)


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        stream: DataStream,
        device: torch.device,
        *,
        schedule: LearningRateSchedule,
        weight_decay: float,
        grad_clip: float,
        compile: bool = False,
        ranks: LocalRanks | None = None,
        precision: Precision = Precision.AUTO,
        optimizer_kind: InnerOptimizerKind = InnerOptimizerKind.ADAMW,
    ):
        self.device = device
        self.precision = StepPrecision(precision, device)  # autocast, and fp16's loss scale
        self.compile = compile
        # on a GPU the next batch is drawn while the device runs the current step (DataStream.prefetch)
        self.prefetch_batches = device.type == "cuda"
        self.ranks = ranks  # this host's other training ranks, when it has several (training/ranks/host.py)
        self.sync: RankSync | None = None  # how the other ranks follow rank 0 (None: one device)
        self.local_weights: LocalWeights  # θ_l as the replica reads and writes it
        if ranks is not None and ranks.shard:  # the flat buffer holds θ_l's first values, until the shards do
            self.flat = FlatParameters(model.named_parameters(), learned_buffers(model))
            self.model = model.to(device)
            self.sync = self.local_weights = HostShards(ranks, self.flat, self.model, device)
        else:
            self.model = model.to(device)
            self.flat = FlatParameters(self.model.named_parameters(), learned_buffers(self.model))
            self.sync = ReplicatedRanks(ranks, self.flat, self.model) if ranks is not None else None
            self.local_weights = FlatLocal(self.flat.buffer, self._params_changed)
        self._trainable = ordered_parameters(self.model)
        self.forward_model = self._forward_model()
        self.ranks_need_params = True  # θ_l changed outside an inner step: the other ranks need it
        self.ranks_need_inner = False  # the AdamW state was replaced: the other ranks need it
        self.stream = stream
        self.schedule = schedule
        self.lr = schedule(0)  # the rate of the last step taken (or of the next one, before it)
        self.grad_clip = grad_clip
        self.optimizer_kind = optimizer_kind
        self._optimizer = OptimizerBuild(self.model, self.lr, weight_decay, optimizer_kind)
        # set after the first AdamW step, whose lazy imports (torch._dynamo) must not run while
        # another thread imports the same modules (TorchInductor compiling the int8 kernels):
        # Python then hands one thread a partly initialised module
        self.first_step_done = threading.Event()
        self.build_optimizer_in_background()
        self.inner_step = 0
        self.adam_steps = 0  # steps behind the AdamW moments: 0 after a fresh start, whatever inner_step says
        self.last_loss = math.nan
        self.round_tokens = 0  # tokens of the current call to run(), read live by the pacer
        self.round_steps = 0  # steps of the current call to run()
        self.round_seconds = 0.0  # wall time of the current call's steps so far
        self.step_seconds = 0.0  # wall time of the last inner step
        self.eval_seconds = 0.0  # wall time in eval_loss since the node last took it (a round's phase)
        self.running = False  # inner steps under way (/healthz: a thread stuck in one is unhealthy)
        self.progress_at = time.monotonic()  # when the last inner step ended, or the last run began
        self.tokens_per_step = stream.batch_size * stream.seq_len  # the node's batch: all its ranks' rows
        self.delays = StepDelays()  # tests' uneven peers and cold starts

    def build_optimizer_in_background(self) -> concurrent.futures.Future:
        """Start making the inner optimizer on a side thread (once: optimizer_build.py); its future."""
        return self._optimizer.start()

    def _forward_model(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The module a step calls: the model, behind DDP with several ranks, compiled with
        --compile (the compiled module shares the already flattened parameters)."""
        model = self.sync.wrap(self.model) if isinstance(self.sync, ReplicatedRanks) else self.model
        return torch.compile(model) if self.compile else model

    def restart_ranks(self) -> None:
        """After a rank failed: new children, wrapped anew, sent θ_l and the AdamW state.
        A sharded model cannot be taken back from its process group: the node stops instead,
        and its supervisor restarts it from its newest checkpoint."""
        assert self.ranks is not None
        if isinstance(self.sync, HostShards):
            self.ranks.stop()  # what the shards held is lost: nothing is asked of them any more
            raise HostRestartNeeded("a local rank failed under --shard; the node stops so that it restarts whole")
        self.ranks.restart()
        self.forward_model = self._forward_model()
        self.ranks_need_params = self.ranks_need_inner = True

    def stop_ranks(self) -> None:
        if self.ranks is not None:
            self.ranks.stop()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer.result()

    def _params_changed(self) -> None:
        self.ranks_need_params = True  # the other ranks take rank 0's θ_l before their next step

    @property
    def parameters_flat(self) -> torch.Tensor:
        """θ_l: every parameter lives in this one buffer (not on a sharded host: see local_copy)."""
        if isinstance(self.sync, HostShards):
            raise TypeError("a sharded host keeps θ_l in its ranks' shards only: read it with local_weights")
        return self.flat.buffer

    def local_copy(self) -> torch.Tensor:
        """A flat copy of θ_l, on any host (tests and tools: on a sharded host it gathers the shards)."""
        copy = torch.empty(self.local_weights.numel, dtype=torch.float32, device=self.local_weights.span_device)
        self.local_weights.read(lambda span, values: copy[span].copy_(values))
        return copy

    def _set_lr(self, position: int) -> None:
        self.lr = self.schedule(position, self.adam_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def run(
        self,
        steps: int,
        stop: threading.Event,
        deadline: float | None = None,
        keep_going: Callable[[float], bool] | None = None,
        *,
        position: int = 0,
        span: int | None = None,
        after_step: Callable[[], None] | None = None,
    ) -> InnerResult:
        """Up to `steps` AdamW steps; ends early on `stop`, past the monotonic `deadline`, or
        when `keep_going(expected seconds of the next step)` says the step no longer fits.
        `after_step()` runs on this thread after each step (--overlap lands an average there).

        The learning rate of step i is the schedule's at `position + min(i, span - 1)`: the
        swarm's position (see training/schedule.py), which a fast peer's extra steps do not advance."""
        span = span or steps
        # a round that takes no step (a restarted node arriving late) reports the rate its first
        # step would have taken, not the rate of the process's first step (schedule position 0)
        self.lr = self.schedule(position, self.adam_steps)
        self.model.train()
        started = self.progress_at = time.monotonic()
        self.round_tokens, self.round_seconds, self.round_steps = 0, 0.0, 0
        self.running = True
        try:
            return self._steps(steps, stop, deadline, keep_going, position, span, after_step, started)
        finally:
            self.running = False

    def _steps(
        self,
        steps: int,
        stop: threading.Event,
        deadline: float | None,
        keep_going: Callable[[float], bool] | None,
        position: int,
        span: int,
        after_step: Callable[[], None] | None,
        started: float,
    ) -> InnerResult:
        done, tokens, loss_sum, lr_sum = 0, 0, 0.0, 0.0
        for _ in range(steps):
            if stop.is_set() or (deadline is not None and time.monotonic() > deadline):
                break
            if keep_going is not None and not keep_going(self.step_seconds):
                if done == 0:  # no step this round: let a stale estimate recover, or this peer never steps again
                    self.step_seconds /= 2
                break
            step_started = time.monotonic()
            batch = self.stream.next_batch()
            self._set_lr(position + min(done, span - 1))
            loss_value = self._step(batch, step_started)
            first = not self.first_step_done.is_set()
            self.first_step_done.set()
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"inner loss became {loss_value} at inner step {self.inner_step}")
            self.delays.after_step(stop, step_started, first)
            self.inner_step += 1
            self.adam_steps += 1
            done += 1
            tokens += batch[:, 1:].numel()
            self.round_tokens = tokens
            self.round_seconds = time.monotonic() - started
            if not first:  # the process's first step carries one-off
                self.step_seconds = time.monotonic() - step_started  # initialisation: no estimate
            loss_sum += loss_value
            lr_sum += self.lr
            self.round_steps = done
            self.progress_at = time.monotonic()
            failpoints.hold("stall-training", position // max(span, 1))
            if after_step is not None:
                after_step()
        mean = loss_sum / done if done else math.nan
        if done:
            self.last_loss = mean
        return InnerResult(done, tokens, mean, time.monotonic() - started, lr_sum / done if done else 0.0)

    def _step(self, batch: torch.Tensor, started: float) -> float:
        """One AdamW step on the node's batch (its rows spread over the local ranks); the loss."""
        try:
            if self.ranks is None:
                return inner_step(
                    self.forward_model,
                    self.optimizer,
                    batch,
                    self.device,
                    self.grad_clip,
                    self._trainable,
                    self._ahead,
                    self.precision,
                )
            assert self.sync is not None  # present whenever ranks are
            return self._step_on_ranks(self.ranks, self.sync, batch, started)
        except torch.cuda.OutOfMemoryError as e:
            raise RankOutOfMemory(out_of_memory_line(0, self.device, e)) from None

    @property
    def _ahead(self) -> Callable[[], None] | None:
        """What a step runs once its kernels are queued: drawing the next batch, on a GPU."""
        return self.stream.prefetch if self.prefetch_batches else None

    def _step_on_ranks(self, ranks: LocalRanks, sync: RankSync, batch: torch.Tensor, started: float) -> float:
        if not ranks.running:  # a restart failed: the round fails and the next restart is tried
            raise LocalRankFailure("the local ranks are not running")
        with ranks.collective():
            if self.ranks_need_inner:
                sync.push_inner(self.optimizer)
                self.ranks_need_inner = False
            if self.ranks_need_params:
                sync.push_params()
                self.ranks_need_params = False
            rows = ranks.send_step(self.lr, batch)
            loss = inner_step(
                self.forward_model,
                self.optimizer,
                rows,
                self.device,
                self.grad_clip,
                self._trainable,
                self._ahead,
                self.precision,
            )
            return ranks.collect(loss, time.monotonic() - started, rows[:, 1:].numel())

    @torch.no_grad()
    def inner_state(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The inner optimizer's moments flattened in parameter order (CPU copies; zeros over
        the learned buffers at the flat buffer's end and where Muon keeps no second moment),
        and its step count."""
        if self.sync is not None:
            return self.sync.gather_inner(self.optimizer)
        return flat_moments(self.optimizer, self._trainable, self.flat.numel)

    @torch.no_grad()
    def load_inner_state(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: int) -> None:
        """Install the inner optimizer's moments (a resumed node's own), or with steps 0 start them fresh."""
        self.adam_steps = max(steps, 0)
        if self.sync is not None:  # the other ranks take them before the next step
            self.ranks_need_inner = True
            self.sync.load_inner(self.optimizer, self.model, (exp_avg, exp_avg_sq, steps))
            return
        if steps <= 0 and not self._optimizer.built:  # one still being made starts with no state anyway
            return
        install_inner_state(self.optimizer, self.model, exp_avg, exp_avg_sq, steps)

    def eval_loss(self) -> float | None:
        """Mean loss on the swarm-wide held-out eval set (comparable across peers); None without one."""
        if self.stream.eval_set is None:
            return None
        started = time.monotonic()
        try:
            if self.sync is None:
                return held_out_loss(self.model, self.stream.eval_set, self.device, self.precision.precision)
            if self.sync.evaluates_together and self.ranks is not None and not self.ranks.running:
                return None  # a sharded model's forward passes need every rank, and they are down
            if self.sync.evaluates_together and self.ranks_need_params:  # on θ_l as rank 0 holds it
                self.sync.push_params()
                self.ranks_need_params = False
            assert self.ranks is not None
            with self.ranks.collective():  # a sharded model's forward passes are collectives
                return held_out_loss(
                    self.model, self.sync.eval_tokens(self.stream.eval_set), self.device, self.precision.precision
                )
        finally:
            self.eval_seconds += time.monotonic() - started
