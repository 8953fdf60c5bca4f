"""DiLoCo replica state around the trainer: θ_g, the outer optimizer and the outer step.

θ_g stays on the training device next to θ_l; the pseudo-gradient Δ = θ_g − θ_l is staged
in a (pinned, on CUDA) CPU buffer for the network, and the averaged Δ comes back the same
way. After the outer step θ_l is reset to θ_g; the inner optimizer state is kept. Every write to
θ_l here flags it for the host's other local ranks (`ranks_need_params`), which get it before
their next inner step.

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
from collections import deque
from collections.abc import Callable

import torch

from dtnode.ops.flat import sha256_of
from dtnode.ops.outer_optimizer import NesterovOuterOptimizer

from .trainer import Trainer

DISTANCE_SLICE = 1 << 22  # values per slice of `distance_to`
UPDATES_REMEMBERED = 8  # outer steps whose size `update_scale` takes the largest of


class Replica:
    def __init__(self, trainer: Trainer, outer_lr: float, outer_momentum: float):
        self.trainer = trainer
        local = trainer.parameters_flat
        self.theta_g = local.detach().clone()
        self.outer = NesterovOuterOptimizer(local.numel(), outer_lr, outer_momentum, device=local.device)
        self.outer_step = 0
        pin = local.device.type == "cuda"
        self.delta_cpu = torch.empty(local.numel(), dtype=torch.float32, pin_memory=pin)
        self.mean_cpu = torch.empty(local.numel(), dtype=torch.float32, pin_memory=pin)
        self._delta_device = torch.empty_like(local)
        self._host_theta = torch.empty(local.numel(), dtype=local.dtype, pin_memory=pin) if pin else None
        self._sha256 = sha256_of(self.theta_g)
        self._in_flight: torch.Tensor | None = None  # --overlap: the Δ being averaged, on the device
        self.has_in_flight = False
        self._copy_stream = torch.cuda.Stream(local.device) if pin else None
        self._copied = torch.cuda.Event() if pin else None  # the last copy of Δ to the host is done
        # bounds on the sizes of the last outer steps (0-d tensors, read only when asked), with the
        # round each came from (its inner learning rate scales it: see update_scale)
        self._update_sizes: deque[tuple[torch.Tensor, int]] = deque(maxlen=UPDATES_REMEMBERED)

    @property
    def numel(self) -> int:
        return self.theta_g.numel()

    @torch.no_grad()
    def pseudo_gradient(self) -> torch.Tensor:
        """Δ = θ_g − θ_l into the CPU staging buffer (returned; read it after `delta_on_host`)."""
        self._after_copy()
        torch.sub(self.theta_g, self.trainer.parameters_flat, out=self._delta_device)
        self._copy_to_host(self._delta_device)
        return self.delta_cpu

    def _copy_to_host(self, source: torch.Tensor) -> None:
        """Start Δ's copy into `delta_cpu`: at once on a CPU, on the copy stream on CUDA (after
        the work queued so far on the training stream, which computed `source`)."""
        if self._copy_stream is None or self._copied is None:
            self.delta_cpu.copy_(source)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(self._copy_stream):
            self.delta_cpu.copy_(source, non_blocking=True)
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

    @torch.no_grad()
    def apply_outer_step(self, mean_delta_cpu: torch.Tensor) -> None:
        self._after_copy()
        self._delta_device.copy_(mean_delta_cpu, non_blocking=True)
        self.outer.step(self.theta_g, self._delta_device)
        self._update_sizes.append((self.outer.step_norm_bound(self._delta_device), self.outer_step))
        self.trainer.parameters_flat.copy_(self.theta_g)
        self.trainer.ranks_need_params = True
        self.outer_step += 1
        self._sha256 = ""

    def update_scale(self, rate_of: Callable[[int], float] | None = None, at_rate: float | None = None) -> float | None:
        """The largest of the last few outer steps' sizes (a bound on ‖θ_g after − θ_g before‖),
        or None before this process made one: how far θ_g moves in a step, which tells a
        download that is this node's swarm a few steps on from one that is not.

        With `rate_of` (a round's mean inner learning rate) and `at_rate`, each size is scaled
        to that rate first: Δ grows with the inner rate, and steps measured during its warmup
        (a node paused after its first rounds) are a fraction of the swarm's steps since."""
        if not self._update_sizes:
            return None
        sizes = torch.stack([size for size, _ in self._update_sizes])
        if rate_of is not None and at_rate is not None:
            rates = [rate_of(round_no) for _, round_no in self._update_sizes]
            factors = [at_rate / rate if rate > 0 else 1.0 for rate in rates]
            sizes = sizes * torch.tensor(factors, dtype=sizes.dtype, device=sizes.device)
        return float(sizes.max())

    @torch.no_grad()
    def distance_to(self, theta_g: torch.Tensor) -> float:
        """‖θ_g − theta_g‖ for a host tensor of θ_g's size, in slices on θ_g's device: no
        model-sized temporary (training thread)."""
        if theta_g.shape != self.theta_g.shape:
            raise ValueError(f"θ_g of {theta_g.numel()} values, this model has {self.numel}")
        squares = torch.zeros((), dtype=torch.float64, device=self.theta_g.device)  # one read at the end
        for start in range(0, self.numel, DISTANCE_SLICE):
            own = self.theta_g[start : start + DISTANCE_SLICE]
            other = theta_g[start : start + DISTANCE_SLICE].to(own.device, non_blocking=True)
            squares += torch.dist(own, other).double() ** 2
        return float(squares.sqrt())

    @torch.no_grad()
    def consensus_state(self) -> torch.Tensor:
        """θ_g and the outer momentum, one CPU buffer, for averaging them with peers.

        Both drift apart when members of a group applied different values (a failed part):
        θ_g alone would be pulled apart again by the next outer steps' momentum.
        """
        return torch.cat([self.theta_g.detach().to("cpu", torch.float32), self.outer.momentum_buffer.to("cpu")])

    @torch.no_grad()
    def adopt_consensus_state(self, state_cpu: torch.Tensor) -> None:
        """Take the swarm's averaged θ_g and momentum (before this step's outer update)."""
        n = self.numel
        self.theta_g.copy_(state_cpu[:n])
        self.outer.momentum_buffer.copy_(state_cpu[n:])
        self.trainer.parameters_flat.copy_(self.theta_g)
        self.trainer.ranks_need_params = True
        self._sha256 = ""

    @torch.no_grad()
    def load(self, theta_g: torch.Tensor, momentum: torch.Tensor, outer_step: int) -> None:
        self.has_in_flight = False  # any Δ still in flight belongs to the state this replaces
        self.theta_g.copy_(theta_g)
        self.outer.load_state_dict({"outer_momentum": momentum})
        self.trainer.parameters_flat.copy_(self.theta_g)
        self.trainer.ranks_need_params = True
        self.outer_step = outer_step
        self._sha256 = ""

    @torch.no_grad()
    def reset_local(self) -> None:
        """θ_l ← θ_g: after a round that left θ_l unusable (a non-finite loss); minus the Δ
        still being averaged, which that average will add to θ_g."""
        if self.has_in_flight:
            torch.sub(self.theta_g, self._in_flight_buffer(), out=self.trainer.parameters_flat)
        else:
            self.trainer.parameters_flat.copy_(self.theta_g)
        self.trainer.ranks_need_params = True

    @torch.no_grad()
    def land(self, mean_cpu: torch.Tensor | None, consensus_cpu: torch.Tensor | None) -> None:
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
        flat = self.trainer.parameters_flat
        in_flight = self._in_flight_buffer()
        self._after_copy()
        torch.sub(self.theta_g, flat, out=self._delta_device)
        if self.has_in_flight and mean_cpu is not None:
            self._delta_device.sub_(in_flight)  # the progress since the Δ in flight was taken
        if consensus_cpu is not None:
            n = self.numel
            self.theta_g.copy_(consensus_cpu[:n])
            self.outer.momentum_buffer.copy_(consensus_cpu[n:])
            self._sha256 = ""
        if mean_cpu is not None:
            in_flight.copy_(mean_cpu, non_blocking=True)  # a staging buffer here
            self.outer.step(self.theta_g, in_flight)
            self._update_sizes.append((self.outer.step_norm_bound(in_flight), self.outer_step))
            self.outer_step += 1
            self._sha256 = ""
        torch.sub(self.theta_g, self._delta_device, out=flat)
        self.trainer.ranks_need_params = True
        self.has_in_flight = False

    @torch.no_grad()
    def stage_delta(self) -> torch.Tensor:
        """--overlap, at a round's end, after `land`: this round's Δ = θ_g − θ_l becomes the Δ in
        flight, staged for the network (returned; read it after `delta_on_host`)."""
        in_flight = self._in_flight_buffer()
        self._after_copy()
        torch.sub(self.theta_g, self.trainer.parameters_flat, out=in_flight)
        self.has_in_flight = True
        self._copy_to_host(in_flight)
        return self.delta_cpu

    def delayed_outer_step(self, mean_cpu: torch.Tensor | None, consensus_cpu: torch.Tensor | None) -> torch.Tensor:
        """`land` then `stage_delta`: a round's end whose previous average had not landed yet."""
        self.land(mean_cpu, consensus_cpu)
        return self.stage_delta()

    def _in_flight_buffer(self) -> torch.Tensor:
        if self._in_flight is None:
            self._in_flight = torch.zeros_like(self.trainer.parameters_flat)
        return self._in_flight

    @torch.no_grad()
    def theta_g_into_model(self) -> None:
        """Put θ_g in the model (to evaluate it); restore_local() puts θ_l back."""
        self.trainer.parameters_flat.copy_(self.theta_g)
        self.trainer.ranks_need_params = True

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
