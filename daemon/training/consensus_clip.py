"""A re-synced state held to this node's drift bound: how far it would move θ_g (or the outer
momentum), and the move scaled down in place where it goes past the bound.

Each part of a re-sync was checked on its own against twice its share of the bound, and a
member that took every part of a pair's re-sync to its limit moved θ_g twice the bound; so the
whole state is measured and clipped here too. Honest states lie well within it; a clipped one
leaves this node apart from its group, and its next round re-syncs again. The work goes in
slices on the tensor's own device, so a GPU's θ_g is never copied to the host whole.
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("dtnode")

DISTANCE_SLICE = 1 << 22  # values per slice of `moved_by` and `clip_moves`

# one region of a state: (this node's tensor, its offset in the state, the bound of its move)
Region = tuple[torch.Tensor, int, float]


def moved_by(state_cpu: torch.Tensor, ours: torch.Tensor, offset: int) -> float:
    """‖state_cpu[offset : offset + n] − ours‖ (n = ours' size), in slices on `ours`' device."""
    n = ours.numel()
    squares = torch.zeros((), dtype=torch.float64, device=ours.device)  # one read at the end
    for at in range(0, n, DISTANCE_SLICE):
        end = min(at + DISTANCE_SLICE, n)
        values = state_cpu[offset + at : offset + end].to(ours.device, non_blocking=True)
        squares += torch.linalg.vector_norm(values - ours[at:end], dtype=torch.float64) ** 2
    return math.sqrt(float(squares))


@torch.no_grad()
def clip_moves(state_cpu: torch.Tensor, regions: list[Region]) -> int:
    """Each region of `state_cpu` moved in place to within its bound of ours (a move that is not
    finite: not at all); how many regions were clipped (each said as a warning)."""
    clipped = 0
    for ours, offset, bound in regions:
        moved = moved_by(state_cpu, ours, offset)
        if moved <= bound:
            continue
        n = ours.numel()
        factor = bound / moved if math.isfinite(moved) else 0.0
        for at in range(0, n, DISTANCE_SLICE):
            end = min(at + DISTANCE_SLICE, n)
            own = ours[at:end].to("cpu", torch.float32)
            target = state_cpu[offset + at : offset + end]
            target.sub_(own).mul_(factor).add_(own)
            if not math.isfinite(moved):
                target.copy_(own)
        log.warning(
            "a θ_g re-sync would move this node's %s by %.4g, over its bound of %.4g: moved that far only",
            "θ_g" if offset == 0 else "outer momentum",
            moved,
            bound,
        )
        clipped += 1
    return clipped
