"""DiLoCo replica state around the trainer: θ_g, the outer optimizer and the outer step.

θ_g stays on the training device next to θ_l; the pseudo-gradient Δ = θ_g − θ_l is staged
in a (pinned, on CUDA) CPU buffer for the network, and the averaged Δ comes back the same
way. On a CPU (and on a sharded host, whose θ_g is in host memory) Δ is computed straight
into its staging buffer and the outer step reads the average where the network left it: no
device-side buffer, which would be a third model-sized copy of Δ in the same memory. There,
with the int8 codec, `CodedReplica` (training/coded_replica.py) holds Δ as int8 codes instead.

θ_l is read and written span by span through the trainer's `LocalWeights` (training/theta_local.py):
the trainer's flat buffer on one device or DDP ranks, the parameters gathered from and sent to
the shards one at a time on a sharded host, which holds no copy of θ_l of its own. After the
outer step θ_l is reset to θ_g; the inner optimizer state is kept. Every write to θ_l here
reaches the host's other local ranks before their next inner step.

On CUDA the device-to-host copy of Δ runs on a copy stream of its own: the training thread
does not wait for it, the next inner steps (with --overlap) and the group's matchmaking run
while the copy engine moves Δ, and the averager waits for it (`delta_on_host`) only before
its first read. Every later write to the device buffer the copy reads waits for it on the
device (`_after_copy`), never on the host.

With --overlap the node keeps training while its last Δ is averaged, and the outer step of
that average lands as soon as it is in (`land`, between two inner steps), not a round late:
θ_l is moved onto the new θ_g with the progress made since the Δ was taken kept on top.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from dtnode.daemon.training.consensus_clip import Region, clip_moves, moved_by
from dtnode.daemon.training.ranks.host import LocalRankFailure
from dtnode.daemon.training.trainer import Trainer
from dtnode.daemon.training.update_bounds import UpdateBounds
from dtnode.ops.coded import CodedDelta
from dtnode.ops.flat import sha256_of
from dtnode.ops.outer_optimizer import NesterovOuterOptimizer
from dtnode.peers.part_result import DriftBound

log = logging.getLogger("dtnode")


class Replica:
    def __init__(self, trainer: Trainer, outer_lr: float, outer_momentum: float):
        self.trainer = trainer
        self.local = trainer.local_weights
        n, device = self.local.numel, self.local.span_device
        self.theta_g = torch.empty(n, dtype=torch.float32, device=device)
        self.local.read(lambda span, values: self.theta_g[span].copy_(values))
        self.outer = NesterovOuterOptimizer(n, outer_lr, outer_momentum, device=device)
        self.outer_step = 0
        pin = device.type == "cuda"
        # Δ for the network, and the average it comes back as (written in place, see PartResult)
        self.delta_cpu: torch.Tensor | CodedDelta = self._new_staging(n, pin)
        # Δ on the device (CUDA only: on a CPU the staging buffers are on the device already)
        self._delta_device = torch.empty(n, dtype=torch.float32, device=device) if pin else None
        self._host_theta = torch.empty(n, dtype=torch.float32, pin_memory=pin) if pin else None
        self._sha256 = sha256_of(self.theta_g)
        self._in_flight: torch.Tensor | None = None  # --overlap: the Δ being averaged, on the device
        self.has_in_flight = False
        self._copy_stream = torch.cuda.Stream(device) if pin else None
        self._copied = torch.cuda.Event() if pin else None  # the last copy of Δ to the host is done
        self.bounds = UpdateBounds(self.outer, n)  # how far the swarm may move θ_g and the momentum
        self.resyncs_clipped = 0  # re-synced states moved only part of the way (consensus_clip.py)

    def _new_staging(self, n: int, pin: bool) -> torch.Tensor | CodedDelta:
        """The buffer Δ is staged in for the network: fp32 here (pinned on CUDA)."""
        return torch.empty(n, dtype=torch.float32, pin_memory=pin)

    @property
    def numel(self) -> int:
        return self.theta_g.numel()

    @property
    def coded(self) -> bool:
        """Δ is staged as int8 codes (CodedReplica), not in fp32."""
        return False

    def _fp32_staging(self) -> torch.Tensor:
        assert isinstance(self.delta_cpu, torch.Tensor)  # a CodedReplica overrides what calls this
        return self.delta_cpu

    @torch.no_grad()
    def pseudo_gradient(self) -> torch.Tensor | CodedDelta:
        """Δ = θ_g − θ_l into the CPU staging buffer (returned; read it after `delta_on_host`)."""
        self._after_copy()
        target = self._fp32_staging() if self._delta_device is None else self._delta_device
        self._difference_into(target)
        self.bounds.measure_own(target)
        if self._delta_device is not None:
            self._copy_to_host(self._delta_device)
        return self.delta_cpu

    def _difference_into(self, target: torch.Tensor) -> None:
        """target ← θ_g − θ_l."""
        self.local.read(lambda span, values: torch.sub(self.theta_g[span], values, out=target[span]))

    def _local_from(self, source: torch.Tensor, minus: torch.Tensor | None = None) -> None:
        """θ_l ← source (− minus)."""
        if minus is None:
            self.local.write(lambda span, out: out.copy_(source[span]))
        else:
            self.local.write(lambda span, out: torch.sub(source[span], minus[span], out=out))

    def _copy_to_host(self, source: torch.Tensor) -> None:
        """Start Δ's copy into `delta_cpu`: at once on a CPU, on the copy stream on CUDA (after
        the work queued so far on the training stream, which computed `source`)."""
        staged = self._fp32_staging()
        if self._copy_stream is None or self._copied is None:
            staged.copy_(source)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(self._copy_stream):
            staged.copy_(source, non_blocking=True)
            self._copied.record(self._copy_stream)

    def _after_copy(self) -> None:
        """The training stream's next work waits for the copy of Δ (it may overwrite its source,
        or read `delta_cpu` back as the average); a device-side wait, the thread goes on."""
        if self._copied is not None:
            torch.cuda.current_stream(self.theta_g.device).wait_event(self._copied)

    def delta_copied(self) -> bool:
        return self._copied is None or self._copied.query()

    async def delta_on_host(self) -> None:
        """Returns once `delta_cpu` holds the Δ last staged (at once on a CPU). Polls the
        event: a copy takes milliseconds, and a thread blocked in it could not be cancelled."""
        while not self.delta_copied():
            await asyncio.sleep(0.001)

    def _mean_on_device(self, mean_cpu: torch.Tensor | CodedDelta) -> torch.Tensor | CodedDelta:
        """The averaged Δ where θ_g is: in place on a CPU (coded or not), else copied into the
        device buffer (after the copy of Δ out of it)."""
        if self._delta_device is None or isinstance(mean_cpu, CodedDelta):
            return mean_cpu
        self._after_copy()
        self._delta_device.copy_(mean_cpu, non_blocking=True)
        return self._delta_device

    @torch.no_grad()
    def apply_outer_step(
        self,
        mean_delta_cpu: torch.Tensor | CodedDelta,
        consensus_cpu: torch.Tensor | None = None,
        bound: DriftBound | None = None,
    ) -> None:
        """The outer step of the averaged Δ, on the swarm's re-synced θ_g and momentum first when
        the round re-synced them (`consensus_cpu`, held to `bound`); θ_l ← θ_g once, after both."""
        self._take_consensus(consensus_cpu, bound)
        self._outer_step(mean_delta_cpu)
        self._local_from(self.theta_g)

    def _outer_step(self, mean_cpu: torch.Tensor | CodedDelta) -> None:
        """θ_g's outer step of the averaged Δ, and its size remembered (`update_scale`)."""
        mean = self.bounds.bounded(self._mean_on_device(mean_cpu))
        self.bounds.bound_momentum(mean)
        self.outer.step(self.theta_g, mean)
        self._stepped(mean)

    def _stepped(self, mean: torch.Tensor | CodedDelta) -> None:
        """An outer step was made along `mean`: its size remembered, the count and hash moved on."""
        self.bounds.stepped(mean, self.outer_step)
        self.outer_step += 1
        self._sha256 = ""

    @torch.no_grad()
    def distance_to(self, theta_g: torch.Tensor) -> float:
        """‖θ_g − theta_g‖ for a host tensor of θ_g's size, in slices on θ_g's device: no
        model-sized temporary (training thread)."""
        if theta_g.shape != self.theta_g.shape:
            raise ValueError(f"θ_g of {theta_g.numel()} values, this model has {self.numel}")
        return moved_by(theta_g, self.theta_g, 0)

    @torch.no_grad()
    def consensus_state(self) -> torch.Tensor:
        """θ_g and the outer momentum, one CPU buffer (a copy), for averaging them with peers.

        Both drift apart when members of a group applied different values (a failed part):
        θ_g alone would be pulled apart again by the next outer steps' momentum. Without outer
        momentum (plain SGD, sparse's default; the recipe makes it the swarm's) there is no
        buffer, and the state is θ_g alone: a re-sync moves 4 bytes per parameter each way, not 8.
        """
        if self.outer.momentum == 0:
            return self.theta_g.detach().to("cpu", torch.float32, copy=True)
        return torch.cat([self.theta_g.detach().to("cpu", torch.float32), self.outer.momentum_buffer.to("cpu")])

    def _take_consensus(self, state_cpu: torch.Tensor | None, bound: DriftBound | None = None) -> None:
        """The swarm's averaged θ_g and momentum (before this step's outer update), if re-synced
        (θ_g alone from a `consensus_state` without momentum)."""
        if state_cpu is None:
            return
        self._check_consensus(state_cpu, bound)
        self._consensus_range(state_cpu, 0, self.numel)

    def _check_consensus(self, state_cpu: torch.Tensor, bound: DriftBound | None = None) -> None:
        """A re-synced state of the right size, its move clipped to `bound` (this round's
        `resync_bound` if none: the averager's, shared among its group, is tighter)."""
        n = self.numel
        if state_cpu.numel() not in (n, 2 * n):
            raise ValueError(f"a consensus state holds θ_g and maybe the momentum: {state_cpu.numel()} values for {n}")
        self._clip_consensus(state_cpu, bound or self.bounds.drift)

    def _clip_consensus(self, state_cpu: torch.Tensor, drift: DriftBound | None) -> None:
        """The re-synced state moved in place to within `drift` of ours, as a whole (θ_g and the
        momentum each: training/consensus_clip.py)."""
        if drift is None:
            return
        regions: list[Region] = [(self.theta_g, 0, drift.theta)]
        if state_cpu.numel() == 2 * self.numel and self.outer.momentum > 0:
            regions.append((self.outer.momentum_buffer, self.numel, drift.momentum))
        self.resyncs_clipped += clip_moves(state_cpu, regions)

    def _consensus_range(self, state_cpu: torch.Tensor, start: int, stop: int) -> None:
        """θ_g (and the momentum) [start, stop) ← the re-synced state's (checked)."""
        n = self.numel
        self.theta_g[start:stop].copy_(state_cpu[start:stop])
        if state_cpu.numel() == 2 * n and self.outer.momentum > 0:
            self.outer.momentum_buffer[start:stop].copy_(state_cpu[n + start : n + stop])
        self._sha256 = ""

    @torch.no_grad()
    def load(self, theta_g: torch.Tensor, momentum: torch.Tensor, outer_step: int) -> None:
        self.has_in_flight = False  # any Δ still in flight belongs to the state this replaces
        self.theta_g.copy_(theta_g)
        self.outer.load_state_dict({"outer_momentum": momentum})
        self._local_from(self.theta_g)
        self.outer_step = outer_step
        self._sha256 = ""

    @torch.no_grad()
    def reset_local(self) -> None:
        """θ_l ← θ_g: after a round that left θ_l unusable (a non-finite loss); minus the Δ
        still being averaged, which that average will add to θ_g."""
        self._local_from(self.theta_g, self._in_flight_buffer() if self.has_in_flight else None)

    @torch.no_grad()
    def land(
        self,
        mean_cpu: torch.Tensor | CodedDelta | None,
        consensus_cpu: torch.Tensor | None,
        bound: DriftBound | None = None,
    ) -> None:
        """--overlap: the outer step of the Δ in flight, made once its average is in: between
        two inner steps of the next round (as soon as it arrives), or at that round's end.

        Invariant: θ_l = θ_g − (the Δ in flight) − (progress since that Δ was taken). The
        swarm's mean replaces this peer's own part of it and the newer progress stays:
        θ_l ← θ_g' − progress. Every member of a group applies the same mean to the same θ_g,
        so θ_g stays bit-identical across the group as without overlap. A failed average (mean
        None) leaves θ_l as it is: its Δ goes out again inside the next one, as a failed round's
        does without overlap. Landing early matters: the sooner the mean replaces the peer's own
        Δ, the closer the run is to DiLoCo without overlap (the convergence benchmark's
        `diloco-hH-delayN` runs: a round late costs 5-10% of held-out loss, a few steps late
        nothing measurable)."""
        # the in-flight buffer is spent here: it takes minus the progress to keep, θ_l − θ_g (+ the
        # Δ in flight, when its mean replaces it); θ_l is local, so no peer needs this rounding
        lost = self._in_flight_buffer()
        self._after_copy()
        replaced = self.has_in_flight and mean_cpu is not None

        def progress(span: slice, values: torch.Tensor) -> None:
            if replaced:
                lost[span].sub_(self.theta_g[span]).add_(values)
            else:
                torch.sub(values, self.theta_g[span], out=lost[span])

        try:
            self.local.read(progress)
            known = True
        except LocalRankFailure as e:  # a sharded host whose rank died: θ_l is lost, θ_g lands whole
            log.warning("landing the outer step without θ_l (%s): the node restarts from θ_g", e)
            known = False
        self._take_consensus(consensus_cpu, bound)
        if mean_cpu is not None:
            self._outer_step(mean_cpu)
        if known:
            self.local.write(lambda span, out: torch.add(self.theta_g[span], lost[span], out=out))
        self.has_in_flight = False

    @torch.no_grad()
    def stage_delta(self) -> torch.Tensor | CodedDelta:
        """--overlap, at a round's end, after `land`: this round's Δ = θ_g − θ_l becomes the Δ in
        flight, staged for the network (returned; read it after `delta_on_host`)."""
        in_flight = self._in_flight_buffer()
        self._after_copy()
        self._difference_into(in_flight)
        self.bounds.measure_own(in_flight)
        self.has_in_flight = True
        self._copy_to_host(in_flight)
        return self.delta_cpu

    def delayed_outer_step(
        self, mean_cpu: torch.Tensor | CodedDelta | None, consensus_cpu: torch.Tensor | None
    ) -> torch.Tensor | CodedDelta:
        """`land` then `stage_delta`: a round's end whose previous average had not landed yet."""
        self.land(mean_cpu, consensus_cpu)
        return self.stage_delta()

    def _in_flight_buffer(self) -> torch.Tensor:
        if self._in_flight is None:
            self._in_flight = torch.zeros_like(self.theta_g)
        return self._in_flight

    @torch.no_grad()
    def theta_g_into_model(self) -> None:
        """Put θ_g in the model (to evaluate it); restore_local() puts θ_l back."""
        self._local_from(self.theta_g)

    @torch.no_grad()
    def restore_local(self) -> None:
        """θ_l after theta_g_into_model(), from the invariant (θ_g − the Δ in flight)."""
        self.reset_local()

    @property
    def theta_on_host(self) -> bool:
        """θ_g lives in host memory: hashing reads it in place, with no copy on the training thread."""
        return self.theta_g.device.type == "cpu"

    @torch.no_grad()
    def host_theta(self) -> torch.Tensor:
        """θ_g on the host for hashing: θ_g itself on a CPU, else one copy into a pinned buffer.

        Runs on the training thread; the hash itself runs elsewhere, before θ_g next changes.
        """
        if self._host_theta is None:
            return self.theta_g
        self._host_theta.copy_(self.theta_g)
        return self._host_theta

    def set_params_sha256(self, digest: str) -> None:
        self._sha256 = digest

    def params_sha256(self) -> str:
        """Hash of θ_g as of the last outer step ("" while it is being computed)."""
        return self._sha256
