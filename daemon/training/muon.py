"""Muon's step, as torch's `torch.optim.Muon` defines it, with two changes of where it runs.

torch's step is the algorithm this node trains with (Nesterov momentum on the gradient, its
update orthogonalised by five quintic Newton-Schulz iterations, the rate scaled by
0.2·√max(A, B) to match AdamW's RMS), and this class keeps its parameter groups, defaults and
state (`momentum_buffer`), so a checkpoint reads the same. Two things in torch's version cost a
swarm's hosts dearly, and no library offers them otherwise:

- **The iterations run in bfloat16 on every device.** On a GPU that is what its tensor cores
  want; a CPU has no bf16 matrix units and computes it several times slower than fp32 (a `tiny`
  step took 10.0 ms against AdamW's 5.6 ms). Here they run in bf16 on CUDA and in fp32
  elsewhere.
- **On a `--shard` host (FSDP2) the update is a DTensor**, and each of the iterations' fifteen
  products was a collective over the host's ranks: a 2-rank CPU host made a tenth of the steps
  of a 1-rank one, and its Δ, that much shorter, clipped the group's mean on it alone
  (update_bounds.py), splitting its θ_g from its group's. Here each matrix's update is gathered
  once, orthogonalised whole on every rank (the same result on each: the same input, the same
  kernels), and each rank keeps its own rows, with no further traffic.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def orthogonalized(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """US'Vᵀ of update = USVᵀ, S' near 1 (Newton-Schulz, as torch's Muon): in bf16 on a GPU,
    in fp32 elsewhere; a DTensor is gathered whole first and returned in its own placement."""
    if isinstance(update, DTensor):
        whole = orthogonalized(update.full_tensor(), coefficients, steps, eps)
        # every rank holds the same whole matrix: each takes its own part, nothing is sent
        return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
    a, b, c = coefficients
    x = update.to(torch.bfloat16 if update.is_cuda else torch.float32)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # the spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(update.dtype)


def rms_matched_rate(lr: float, shape: torch.Size) -> float:
    """torch's `match_rms_adamw`: an orthogonal update's RMS is 1/√max(A, B); this makes it
    0.2·lr, AdamW's typical update RMS, so one --inner-lr serves both halves."""
    return lr * 0.2 * math.sqrt(max(shape[0], shape[1]))


class Muon(torch.optim.Muon):
    """torch's Muon with the step above (the rate always matched to AdamW's RMS)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        for group in self.param_groups:
            lr, momentum = float(group["lr"]), float(group["momentum"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buffer = state["momentum_buffer"]
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalized(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-rms_matched_rate(lr, p.shape))
        return None
