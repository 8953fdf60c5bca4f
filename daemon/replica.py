"""DiLoCo replica state around the trainer: θ_g, the outer optimizer and the outer step.

θ_g stays on the training device next to θ_l; the pseudo-gradient Δ = θ_g − θ_l is staged
in a (pinned, on CUDA) CPU buffer for the network, and the averaged Δ comes back the same
way. After the outer step θ_l is reset to θ_g; the inner optimizer state is kept.

With --overlap the outer step comes one round late (delayed_outer_step): the node keeps
training while its last Δ is averaged, and θ_l is moved onto each new θ_g with the progress
made since kept on top.
"""

from __future__ import annotations

import torch

from dtnode.ops.flat import sha256_of
from dtnode.ops.outer_optimizer import NesterovOuterOptimizer

from .trainer import Trainer


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

    @property
    def numel(self) -> int:
        return self.theta_g.numel()

    @torch.no_grad()
    def pseudo_gradient(self) -> torch.Tensor:
        """Δ = θ_g − θ_l into the CPU staging buffer (returned)."""
        torch.sub(self.theta_g, self.trainer.parameters_flat, out=self._delta_device)
        self.delta_cpu.copy_(self._delta_device, non_blocking=True)
        if self._delta_device.is_cuda:
            torch.cuda.current_stream(self._delta_device.device).synchronize()
        return self.delta_cpu

    @torch.no_grad()
    def apply_outer_step(self, mean_delta_cpu: torch.Tensor) -> None:
        self._delta_device.copy_(mean_delta_cpu, non_blocking=True)
        self.outer.step(self.theta_g, self._delta_device)
        self.trainer.parameters_flat.copy_(self.theta_g)
        self.outer_step += 1
        self._sha256 = ""

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
        self._sha256 = ""

    @torch.no_grad()
    def load(self, theta_g: torch.Tensor, momentum: torch.Tensor, outer_step: int) -> None:
        self.has_in_flight = False  # any Δ still in flight belongs to the state this replaces
        self.theta_g.copy_(theta_g)
        self.outer.load_state_dict({"outer_momentum": momentum})
        self.trainer.parameters_flat.copy_(self.theta_g)
        self.outer_step = outer_step
        self._sha256 = ""

    @torch.no_grad()
    def reset_local(self) -> None:
        """θ_l ← θ_g: after a round that left θ_l unusable (a non-finite loss); minus the Δ
        still being averaged, which that average will add to θ_g."""
        if self.has_in_flight:
            torch.sub(self.theta_g, self._in_flight, out=self.trainer.parameters_flat)
        else:
            self.trainer.parameters_flat.copy_(self.theta_g)

    @torch.no_grad()
    def delayed_outer_step(self, mean_cpu: torch.Tensor | None, consensus_cpu: torch.Tensor | None) -> torch.Tensor:
        """--overlap, at the end of a round's inner steps: apply the previous round's averaged Δ
        (when its averaging succeeded) and stage this round's Δ for the network (returned).

        Invariant: θ_l = θ_g − (the Δ in flight) − (this round's progress). So this round's own
        Δ is θ_g − θ_l minus the Δ in flight, and after the outer step θ_l ← θ_g' − Δ: the
        swarm's update replaces this peer's part of it, its newer progress stays. Every member
        of a group applies the same mean to the same θ_g, so θ_g stays bit-identical across the
        group as without overlap. When the previous averaging failed (mean None) its Δ is not
        subtracted: it goes out again inside this round's, as a failed round's does without overlap.
        """
        flat = self.trainer.parameters_flat
        if self._in_flight is None:
            self._in_flight = torch.zeros_like(flat)
        torch.sub(self.theta_g, flat, out=self._delta_device)
        if self.has_in_flight and mean_cpu is not None:
            self._delta_device.sub_(self._in_flight)
        if consensus_cpu is not None:
            n = self.numel
            self.theta_g.copy_(consensus_cpu[:n])
            self.outer.momentum_buffer.copy_(consensus_cpu[n:])
            self._sha256 = ""
        if mean_cpu is not None:
            self._in_flight.copy_(mean_cpu, non_blocking=True)  # a staging buffer here
            self.outer.step(self.theta_g, self._in_flight)
            self.outer_step += 1
            self._sha256 = ""
        torch.sub(self.theta_g, self._delta_device, out=flat)
        self._in_flight.copy_(self._delta_device)
        self.has_in_flight = True
        self.delta_cpu.copy_(self._delta_device, non_blocking=True)
        if self._delta_device.is_cuda:
            torch.cuda.current_stream(self._delta_device.device).synchronize()
        return self.delta_cpu

    @torch.no_grad()
    def settle_in_flight(self, mean_cpu: torch.Tensor | None, consensus_cpu: torch.Tensor | None) -> None:
        """--overlap, at the end (stop, --max-rounds): apply the last averaged Δ with nothing
        staged after it; θ_l keeps any progress made since (it is not checkpointed)."""
        self.delayed_outer_step(mean_cpu, consensus_cpu)
        self.has_in_flight = False

    @torch.no_grad()
    def theta_g_into_model(self) -> None:
        """Put θ_g in the model (to evaluate it); restore_local() puts θ_l back."""
        self.trainer.parameters_flat.copy_(self.theta_g)

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
