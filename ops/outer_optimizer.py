"""DiLoCo outer optimizer: torch's SGD with Nesterov momentum, driven on flat buffers.

Given the averaged pseudo-gradient Δ (θ_g − θ_l, so it points downhill like a gradient),
`torch.optim.SGD(nesterov=True)` makes buf ← μ·buf + Δ; θ_g ← θ_g − lr·(Δ + μ·buf). θ_g is
the optimizer's one parameter and Δ its gradient; the momentum buffer is a tensor this class
owns (checkpointed, averaged in a re-sync), installed as the optimizer's state. The update is
in place and deterministic (the single-tensor kernel), so peers that enter with identical
θ_g, momentum and Δ leave with identical θ_g.
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
        # θ_g, re-pointed at the buffer `step` is given (the replica passes the same one each time)
        self._theta = torch.nn.Parameter(torch.zeros(numel, dtype=torch.float32, device=device), requires_grad=False)
        # torch refuses Nesterov without momentum; with μ = 0 both are θ_g ← θ_g − lr·Δ
        self._sgd = torch.optim.SGD([self._theta], lr=lr, momentum=momentum, nesterov=momentum > 0, foreach=False)
        if momentum > 0:
            self._sgd.state[self._theta]["momentum_buffer"] = self.momentum_buffer

    @torch.no_grad()
    def step(self, params: torch.Tensor, pseudo_gradient: torch.Tensor) -> None:
        if params.shape != pseudo_gradient.shape or params.shape != self.momentum_buffer.shape:
            raise ValueError("outer step buffers differ in shape")
        self._theta.data = params
        self._theta.grad = pseudo_gradient
        try:
            self._sgd.step()
        finally:
            self._theta.grad = None

    @torch.no_grad()
    def step_norm_bound(self, pseudo_gradient: torch.Tensor) -> torch.Tensor:
        """An upper bound on how far the last `step` moved θ_g: lr·(‖Δ‖ + μ·‖buf‖) ≥ ‖lr·(Δ + μ·buf)‖
        (for plain SGD, μ = 0, it is exact). A 0-d tensor on the buffers' device, so a caller on
        CUDA does not wait for it until it reads it; two passes over flat buffers, no copy."""
        bound = torch.linalg.vector_norm(pseudo_gradient)
        if self.momentum > 0:
            bound = bound + self.momentum * torch.linalg.vector_norm(self.momentum_buffer)
        return self.lr * bound

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"outer_momentum": self.momentum_buffer}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        src = state["outer_momentum"]
        if src.shape != self.momentum_buffer.shape or src.dtype != torch.float32:
            raise ValueError("outer momentum buffer has the wrong shape or dtype")
        self.momentum_buffer.copy_(src)
