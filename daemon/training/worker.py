"""The model side of a node: θ_l (the trainer), θ_g and the outer optimizer (the replica), and
the one training thread that changes them.

Everything that touches the model runs on that thread, in order: inner steps, the outer
step, a landing (--overlap), an install of a downloaded checkpoint, an eval. The event loop
never waits on it except through `call`. θ_g and the outer momentum change only under
`theta_changing()`, which also tells the checkpoint store (whose memory checkpoints and
file writes read those tensors in place) and bumps a version a reader can compare.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import TypeVar

import torch

from dtnode.daemon.checkpoints.file_format import Layout, LoadedCheckpoint, LocalState, SharedBytes, TrainingState
from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.training.assembly import assemble
from dtnode.daemon.training.outer_replica import Replica
from dtnode.daemon.training.ranks.host import (
    LocalRankFailure,
    LocalRanks,
    RankReport,
    RankState,
    own_memory,
)
from dtnode.daemon.training.trainer import InnerResult, Trainer
from dtnode.daemon.workload.build import Workload
from dtnode.ops.coded import CodedDelta
from dtnode.peers import failpoints
from dtnode.peers.averager import AveragingResult
from dtnode.peers.part_result import DriftBound

RATE_SAMPLES = 32  # schedule positions a round's mean rate is taken over
log = logging.getLogger("dtnode")

T = TypeVar("T")


class WorkerNotReady(RuntimeError):
    """The model is still being built (the node is starting)."""


def limit_tensor_threads(threads: int | None) -> None:
    """Apply `--threads-per-rank` to the event loop's thread and its default executor, where
    the data plane codes and decodes chunks. Under OpenMP `torch.set_num_threads` holds for the
    calling thread only: the training thread sets its own (`ModelWorker.build`), and before this
    the loop's threads kept torch's default of every core. Their ops on tensors past torch's
    grain size then opened parallel regions of every core, and with more busy threads than
    cores (several nodes on one box, as in `dtnode local` and the drills) the spinning OpenMP
    teams made a sparse chunk's decoding 10x slower (44 ms for a chunk of 1M values instead of
    1.6 with one thread). Call on the loop's thread."""
    if threads is None:
        return
    torch.set_num_threads(threads)
    executor = concurrent.futures.ThreadPoolExecutor(
        thread_name_prefix="tensor", initializer=torch.set_num_threads, initargs=(threads,)
    )
    asyncio.get_running_loop().set_default_executor(executor)


class ModelWorker:
    def __init__(self, settings: NodeSettings, workload: Workload, device: torch.device):
        self.settings = settings
        self.workload = workload
        self.device = device
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train")
        self.theta_lock = threading.Lock()  # θ_g and momentum change (training thread) or are copied (I/O)
        self.theta_version = 0  # bumped at each change of θ_g or the momentum
        self.on_theta_change: Callable[[], None] = lambda: None  # under the lock, before the change
        self.eval_loss: float | None = None
        self.eval_step: int | None = None  # the outer step whose θ_g eval_loss is of (--eval-every)
        self._trainer: Trainer | None = None
        self._replica: Replica | None = None
        # error feedback: what the wire code did not carry yet (int8 when enabled; sparse always)
        self.residual: torch.Tensor | None = None
        self.feedback_norm: float | None = None  # of `residual`, after the last outer step
        # `residual` as the last outer step left it: what a checkpoint of that θ_g saves (with
        # --overlap the next average may be writing `residual` while the checkpoint is taken)
        self._settled_feedback: torch.Tensor | None = None
        self.solo_steps = 0  # the latest outer steps made with no partner in any hop (see catchup/trust_radius.py)

    # ---- set-up ----------------------------------------------------------------------------
    def build(self, peer_id: str) -> None:
        """Put the model on its device with its optimizers and data stream (training thread:
        training/assembly.py)."""
        parts = assemble(self.settings, self.workload, self.device, peer_id)
        self._trainer, self._replica, self.residual = parts.trainer, parts.replica, parts.residual

    @property
    def built(self) -> bool:
        return self._replica is not None

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise WorkerNotReady("the model is still being built")
        return self._trainer

    @property
    def replica(self) -> Replica:
        if self._replica is None:
            raise WorkerNotReady("the model is still being built")
        return self._replica

    @property
    def layout(self) -> Layout:
        flat = self.trainer.flat
        return Layout(tuple(flat.names), tuple(flat.shapes), outer_momentum=self.settings.diloco.outer_momentum > 0)

    @property
    def outer_step(self) -> int:
        return self._replica.outer_step if self._replica is not None else 0

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the training thread, after what is queued there."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, partial(fn, *args))

    def shutdown(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=True)
        if self._trainer is not None:
            self._trainer.stop_ranks()

    @property
    def ranks(self) -> LocalRanks | None:
        return self._trainer.ranks if self._trainer is not None else None

    def rank_reports(self) -> list[RankReport]:
        """Every local rank's last figures; a one-rank node's from its own trainer."""
        if self._trainer is None:
            return []
        if self._trainer.ranks is not None:
            return list(self._trainer.ranks.reports)
        trainer = self._trainer
        rss, peak = own_memory(self.device)
        return [
            RankReport(
                0,
                str(self.device),
                RankState.TRAINING if trainer.running else RankState.IDLE,
                os.getpid(),
                trainer.step_seconds,
                trainer.tokens_per_step / trainer.step_seconds if trainer.step_seconds > 0 else 0.0,
                int(rss),
                int(peak),
            )
        ]

    def restart_ranks(self) -> None:
        """A local rank failed (training thread): all of them anew, from θ_g. The round's
        steps are lost with θ_l; the inner AdamW state is kept, as through any outer step."""
        self.trainer.restart_ranks()
        self.replica.reset_local()

    @contextlib.contextmanager
    def theta_changing(self) -> Iterator[None]:
        """Hold the lock while θ_g or the momentum change (see the module docstring)."""
        with self.theta_lock:
            self.theta_version += 1
            self.on_theta_change()
            yield

    # ---- on the training thread -------------------------------------------------------------
    def run_inner(
        self,
        steps: int,
        stop: threading.Event,
        deadline: float | None,
        keep_going: Callable[[float], bool] | None,
        position: int,
        span: int,
        after_step: Callable[[], None] | None,
    ) -> InnerResult:
        return self.trainer.run(steps, stop, deadline, keep_going, position=position, span=span, after_step=after_step)

    def install(self, loaded: LoadedCheckpoint, local: LocalState | None = None, keep_inner: bool = False) -> None:
        """Load a checkpoint: with this node's own inner state and data position when resuming;
        a donor's checkpoint brings θ_g and the outer momentum only, and the inner optimizer starts
        fresh (with its warmup), or is kept (`keep_inner`) by a node that was training."""
        with self.theta_changing():
            self.replica.load(loaded.theta_g, loaded.momentum, loaded.step)
        self.solo_steps = 0
        if keep_inner:
            return
        trainer = self.trainer
        if local is None:
            trainer.load_inner_state(torch.empty(0), torch.empty(0), 0)
            trainer.inner_step = 0
            if self.residual is not None:  # a donor's θ_g: this node owes the swarm nothing yet
                self.residual.zero_()
                self.measure_feedback()
            return
        if local.inner_optimizer == trainer.optimizer_kind.value:
            trainer.load_inner_state(local.exp_avg, local.exp_avg_sq, local.adam_steps)
        else:  # another optimizer's moments (Muon's hold no second moment, which AdamW divides by)
            log.warning(
                "the saved inner state is %s's and this node trains with %s: the inner optimizer starts fresh",
                local.inner_optimizer,
                trainer.optimizer_kind.value,
            )
            trainer.load_inner_state(torch.empty(0), torch.empty(0), 0)
        trainer.inner_step = local.inner_step
        if self.residual is not None:  # what this node owed the swarm when it stopped (none: a fresh buffer)
            if local.error_feedback is not None:
                self.residual.copy_(local.error_feedback)
            else:
                self.residual.zero_()
            self.measure_feedback()
            log.info("error feedback restored: norm %.6g", self.feedback_norm)
        try:
            sequences = local.sequences_drawn
            if sequences is None:  # an older file: its batches were of this node's size, we assume
                sequences = local.batches_drawn * trainer.stream.batch_size
            trainer.stream.seek(local.generator_state, sequences)
        except (RuntimeError, ValueError) as e:  # a generator state from another torch build
            log.warning("could not restore the data position (%s); continuing from a fresh one", e)

    def reset_local(self) -> None:
        """θ_l ← θ_g with a fresh inner optimizer: after a round whose loss went non-finite."""
        self.replica.reset_local()
        self.trainer.load_inner_state(torch.empty(0), torch.empty(0), 0)

    def end_round_count(self) -> None:
        """This round's tokens are spent: a record must never show the next step with this
        round's tokens, which every peer would add to the next round's progress."""
        self.trainer.round_tokens, self.trainer.round_seconds = 0, 0.0

    def round_rate(self, round_no: int) -> float:
        """The swarm's mean inner learning rate over round `round_no` (schedule positions
        round_no x H onwards, sampled at most RATE_SAMPLES times): what a round's Δ scales with."""
        span = self.settings.diloco.inner_steps
        positions = range(round_no * span, (round_no + 1) * span, max(1, -(-span // RATE_SAMPLES)))
        schedule = self.trainer.schedule
        return sum(schedule(p) for p in positions) / len(positions)

    def pseudo_gradient(self) -> torch.Tensor | CodedDelta:
        return self.replica.pseudo_gradient()

    def apply(self, result: AveragingResult) -> None:
        """Adopt a re-synced θ_g if any, then the outer step of the averaged Δ."""
        self.end_round_count()
        self.replica.bounds.allow_for_group(result.group_shortfall)
        with self.theta_changing():
            self.replica.apply_outer_step(result.mean, result.theta, result.theta_bound)
            if failpoints.take("diverge-theta", self.outer_step - 1):  # a test's fault: one θ_g bit off
                self.replica.theta_g[0] = torch.nextafter(self.replica.theta_g[0], self.replica.theta_g[0] + 1)
        self._count_solo(result)
        self.measure_feedback()

    def resync_bound(self) -> DriftBound:
        """How far this round's θ_g re-sync may move θ_g (training thread: it reads the norms of
        the replica's own Δ, on the training device)."""
        return self.replica.bounds.resync_bound(self.solo_steps)

    def _count_solo(self, result: AveragingResult) -> None:
        self.solo_steps = self.solo_steps + 1 if result.alone else 0

    def measure_feedback(self) -> None:
        """The error-feedback buffer's norm, for the round line and /status (training thread:
        a pass over a model-sized buffer stays off the event loop)."""
        if self.residual is not None:
            self.feedback_norm = float(torch.linalg.vector_norm(self.residual))
            if self._settled_feedback is None:
                self._settled_feedback = torch.empty_like(self.residual)
            self._settled_feedback.copy_(self.residual)

    def land(self, result: AveragingResult | None) -> None:
        """--overlap: the outer step of the average in flight (None: it failed)."""
        with self.theta_changing():
            if result is None:
                self.replica.land(None, None)
            else:
                self.replica.bounds.allow_for_group(result.group_shortfall)
                self.replica.land(result.mean, result.theta, result.theta_bound)
        if result is not None:
            self._count_solo(result)
        self.measure_feedback()

    def adopt_downloaded(self, loaded: LoadedCheckpoint) -> torch.Tensor | CodedDelta:
        """--overlap catch-up: the swarm's θ_g of the next step in place of an outer step of our
        own; this round's Δ staged from it (returned)."""
        self.end_round_count()
        with self.theta_changing():
            delta = self.replica.delayed_outer_step(None, torch.cat([loaded.theta_g, loaded.momentum]))
            self.replica.outer_step = loaded.step
        self.solo_steps = 0
        self.evaluate_theta_g()
        return delta

    def eval_due(self) -> bool:
        every = self.settings.evaluation.eval_every
        return bool(every) and self.outer_step % every == 0

    def evaluate_local(self) -> None:
        """Right after an outer step (θ_l = θ_g): the eval loss of θ_g."""
        self.eval_loss, self.eval_step = self.trainer.eval_loss(), self.outer_step

    def evaluate_theta_g(self, force: bool = False) -> None:
        """The eval loss of θ_g while θ_l differs from it (--overlap): θ_g is swapped in for it."""
        if not (force or self.eval_due()):
            return
        self.replica.theta_g_into_model()
        try:
            self.eval_loss, self.eval_step = self.trainer.eval_loss(), self.outer_step
        finally:
            self.replica.restore_local()

    def snapshot(
        self, local: bool, live: Callable[[int, torch.Tensor, torch.Tensor], SharedBytes] | None = None
    ) -> tuple[int, TrainingState]:
        """θ_g and the momentum (with `local`, this node's inner state too: training thread only).

        With `live`, θ_g and the momentum in host memory are not copied: `live(step, θ_g,
        momentum)` makes the reader of the file's bytes from them, under the lock, so that the
        next change (`on_theta_change`) finds it and gives it copies if it is still reading.
        On a GPU they are copied to the host, as they must be for the file anyway."""
        replica = self.replica
        state_live: SharedBytes | None = None
        with self.theta_lock:
            step = replica.outer_step
            theta, momentum = replica.theta_g.detach(), replica.outer.momentum_buffer
            if live is not None and theta.device.type == "cpu" and momentum.device.type == "cpu":
                state_live = live(step, theta, momentum)
            else:
                theta, momentum = theta.to("cpu", copy=True), momentum.to("cpu", copy=True)
        own = None
        if local:
            trainer = self.trainer
            try:
                exp_avg, exp_avg_sq, adam_steps = trainer.inner_state()
            except LocalRankFailure as e:  # --shard after a rank died: θ_g is whole, the moments are not
                log.warning("writing θ_g without this node's inner optimizer state (%s)", e)
                return step, TrainingState(theta, momentum, None, state_live)
            generator, sequences = trainer.stream.position()
            batches = sequences // trainer.stream.batch_size
            settled = self._settled_feedback if self._settled_feedback is not None else self.residual
            feedback = settled.clone() if settled is not None else None
            own = LocalState(
                exp_avg,
                exp_avg_sq,
                generator,
                trainer.inner_step,
                adam_steps,
                batches,
                sequences,
                feedback,
                trainer.optimizer_kind.value,
            )
        return step, TrainingState(theta, momentum, own, state_live)
