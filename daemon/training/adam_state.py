"""The inner AdamW state as flat buffers in parameter order: what a node's local checkpoint
keeps, and what rank 0 sends the other local ranks. The flat order is FlatParameters' (the
trainable parameters first), so a moment lines up with its parameter on every host."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def ordered_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters, in the flat buffer's order (frozen ones have no optimizer state)."""
    return [p for _, p in model.named_parameters() if p.requires_grad]


@torch.no_grad()
def flat_moments(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], numel: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """AdamW's moments flattened in parameter order (CPU copies; zeros over the learned
    buffers at the flat buffer's end of `numel` values), and its step count."""
    exp_avg = torch.zeros(numel)
    exp_avg_sq = torch.zeros(numel)
    steps, offset = 0, 0
    for p in params:
        n = p.numel()
        state = optimizer.state.get(p)
        if state and "exp_avg" in state:
            exp_avg[offset : offset + n] = state["exp_avg"].reshape(-1).float().cpu()
            exp_avg_sq[offset : offset + n] = state["exp_avg_sq"].reshape(-1).float().cpu()
            steps = int(state["step"])
        offset += n
    return exp_avg, exp_avg_sq, steps


def step_count(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> torch.Tensor:
    """AdamW's step count as its kernels want it: on the parameters' device for the fused and
    capturable kernels (the fused CUDA kernel refuses a count on the host), on the host
    otherwise (torch's own load_state_dict follows the same rule)."""
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return torch.tensor(float(steps), dtype=torch.float32, device=device if on_device else "cpu")


@torch.no_grad()
def install_adam_state(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    steps: int,
) -> None:
    """AdamW moments (flat, in parameter order) into `optimizer`; steps 0 clears its state."""
    if steps <= 0:
        optimizer.state.clear()
        return
    offset = 0
    for p in ordered_parameters(model):
        n = p.numel()
        optimizer.state[p] = {
            "step": step_count(optimizer, steps, p.device),
            "exp_avg": exp_avg[offset : offset + n].view_as(p).to(p.device, copy=True),
            "exp_avg_sq": exp_avg_sq[offset : offset + n].view_as(p).to(p.device, copy=True),
        }
        offset += n
