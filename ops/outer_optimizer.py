"""DiLoCo outer optimizer: SGD with Nesterov momentum on flat buffers.

Given the averaged pseudo-gradient Δ (θ_g − θ_l, so it points downhill like a gradient),
the update is buf ← μ·buf + Δ; θ_g ← θ_g − lr·(Δ + μ·buf), the same rule as torch.optim.SGD
with nesterov=True. It is applied in place and deterministically, so peers that enter with
identical θ_g, momentum and Δ leave with identical θ_g.
"""

from __future__ import annotations

import torch


class NesterovOuterOptimizer:
    def __init__(self, numel: int, lr: float = 0.7, momentum: float = 0.9, device: str | torch.device = "cpu"):
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError("outer lr must be > 0 and momentum in [0, 1)")
        self.lr = lr
        self.momentum = momentum
        self.momentum_buffer = torch.zeros(numel, dtype=torch.float32, device=device)

    @torch.no_grad()
    def step(self, params: torch.Tensor, pseudo_gradient: torch.Tensor) -> None:
        if params.shape != pseudo_gradient.shape or params.shape != self.momentum_buffer.shape:
            raise ValueError("outer step buffers differ in shape")
        buf = self.momentum_buffer
        buf.mul_(self.momentum).add_(pseudo_gradient)
        params.sub_(pseudo_gradient, alpha=self.lr).sub_(buf, alpha=self.lr * self.momentum)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"outer_momentum": self.momentum_buffer}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        src = state["outer_momentum"]
        if src.shape != self.momentum_buffer.shape or src.dtype != torch.float32:
            raise ValueError("outer momentum buffer has the wrong shape or dtype")
        self.momentum_buffer.copy_(src)
