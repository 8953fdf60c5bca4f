"""Muon's step as `torch.optim.Muon` takes it, except on a `--shard` host and on hardware
without bf16 matrix units.

torch's step is the algorithm this node trains with (Nesterov momentum on the gradient, its
update orthogonalised by five quintic Newton-Schulz iterations in bf16, the rate scaled by
0.2·√max(A, B) to match AdamW's RMS), and this class keeps its parameter groups, defaults,
state (`momentum_buffer`) and, where bf16 products run natively, its very arithmetic.

Where they do not (a CPU without AVX512-BF16 or AMX, a GPU older than Ampere), each bf16 product
is emulated: on a 2-core AVX2 host the iterations took 9-14x as long in bf16 as in fp32 for
`tiny`'s matrices and 34-68x for 768x256 and 1024x1024 ones (23.8 s against 0.35 s for one
1024x1024 update), and in a 32-node swarm of `tiny` nodes they were 22% of a node's CPU samples
during its rounds (py-spy). There the iterations run in fp32: the same algorithm, rounded less.

On a `--shard` host (FSDP2) the update is a DTensor, and in torch's step each of the
iterations' fifteen matrix products was a collective over the host's ranks: a 2-rank CPU host
made a tenth of the steps of a 1-rank one, and its Δ, that much shorter, clipped the group's mean
on it alone (update_bounds.py), splitting its θ_g from its group's (CI, issue 59). Here each
matrix's update is gathered once, orthogonalised whole on every rank (the same result on each:
the same input, the same kernels), and each rank keeps its own rows, with no further traffic.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


@functools.cache
def native_bf16(device_type: str) -> bool:
    """Whether bf16 matrix products run on this kind of device's own units (see the module):
    CUDA from Ampere on, a CPU with AVX512-BF16 or AMX, and other accelerators as torch's Muon
    assumes. torch.cpu's probes are private: without them, a CPU counts as without."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type == "cpu":
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(bool(getattr(torch.cpu, probe, lambda: False)()) for probe in probes)
    return True


def iteration_dtype(device: torch.device) -> torch.dtype:
    """bf16 as torch's Muon where the device multiplies it natively, fp32 elsewhere."""
    return torch.bfloat16 if native_bf16(device.type) else torch.float32


def orthogonalized(
    update: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """US'Vᵀ of update = USVᵀ, S' near 1 (Newton-Schulz, as torch's Muon), in `dtype` (by default
    `iteration_dtype` of its device); a DTensor is gathered whole first and returned in its own
    placement."""
    if isinstance(update, DTensor):
        whole = orthogonalized(update.full_tensor(), coefficients, steps, eps, dtype)
        # every rank holds the same whole matrix: each takes its own part, nothing is sent
        return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
    a, b, c = coefficients
    x = update.to(dtype or iteration_dtype(update.device))
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))  # the spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def rms_matched_rate(lr: float, shape: torch.Size) -> float:
    """torch's `match_rms_adamw`: an orthogonal update's RMS is 1/√max(A, B); this makes it
    0.2·lr, AdamW's typical update RMS, so one --inner-lr serves both halves."""
    return lr * 0.2 * math.sqrt(max(shape[0], shape[1]))


class Muon(torch.optim.Muon):
    """torch's Muon with the step above (the rate always matched to AdamW's RMS)."""

    # the iterations' dtype; None: `iteration_dtype` of each parameter's device
    iteration_dtype: torch.dtype | None = None

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
                update = orthogonalized(
                    update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.iteration_dtype
                )
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-rms_matched_rate(lr, p.shape))
        return None
