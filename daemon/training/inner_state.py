"""The inner optimizer's state as flat buffers in parameter order: what a node's local
checkpoint keeps, and what rank 0 sends the other local ranks. The flat order is
FlatParameters' (the trainable parameters first), so a moment lines up with its parameter on
every host.

Two flat buffers whatever the optimizer: AdamW's first and second moments, or for a matrix
Muon holds its momentum and zeros (`inner_optimizer.moment_names` says which entry is which),
so a checkpoint's layout does not depend on `--inner-optimizer`, and the recipe check keeps a
node from reading another optimizer's state as its own."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtnode.daemon.training.inner_optimizer import moment_names


def ordered_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters, in the flat buffer's order (frozen ones have no optimizer state)."""
    return [p for _, p in model.named_parameters() if p.requires_grad]


@torch.no_grad()
def flat_moments(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], numel: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The optimizer's moments flattened in parameter order (CPU copies; zeros over the
    learned buffers at the flat buffer's end of `numel` values), and its step count."""
    first_moments = torch.zeros(numel)
    second_moments = torch.zeros(numel)
    steps, offset = 0, 0
    for p in params:
        n = p.numel()
        state = optimizer.state.get(p)
        first, second = moment_names(optimizer, p)
        if state and first in state:
            first_moments[offset : offset + n] = state[first].reshape(-1).float().cpu()
            if second is not None:
                second_moments[offset : offset + n] = state[second].reshape(-1).float().cpu()
            steps = max(steps, int(state.get("step", 0)))
        offset += n
    return first_moments, second_moments, steps


def step_count(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> torch.Tensor:
    """AdamW's step count as its kernels want it: on the parameters' device for the fused and
    capturable kernels (the fused CUDA kernel refuses a count on the host), on the host
    otherwise (torch's own load_state_dict follows the same rule)."""
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return torch.tensor(float(steps), dtype=torch.float32, device=device if on_device else "cpu")


def moment_state(
    optimizer: torch.optim.Optimizer,
    param: torch.Tensor,
    steps: int,
    device: torch.device,
    first: torch.Tensor,
    second: torch.Tensor,
) -> dict[str, torch.Tensor | int]:
    """One parameter's optimizer state from its moments (already shaped and placed like it)."""
    first_name, second_name = moment_names(optimizer, param)
    if second_name is None:  # Muon: its momentum, and the count the combined optimizer keeps
        return {"step": steps, first_name: first}
    return {"step": step_count(optimizer, steps, device), first_name: first, second_name: second}


@torch.no_grad()
def install_inner_state(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    first_moments: torch.Tensor,
    second_moments: torch.Tensor,
    steps: int,
) -> None:
    """Moments (flat, in parameter order) into `optimizer`; steps 0 clears its state."""
    if steps <= 0:
        optimizer.state.clear()
        return
    offset = 0
    for p in ordered_parameters(model):
        n = p.numel()
        optimizer.state[p] = moment_state(
            optimizer,
            p,
            steps,
            p.device,
            first_moments[offset : offset + n].view_as(p).to(p.device, copy=True),
            second_moments[offset : offset + n].view_as(p).to(p.device, copy=True),
        )
        offset += n
