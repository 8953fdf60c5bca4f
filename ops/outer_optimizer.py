"""DiLoCo outer optimizer: SGD with Nesterov momentum on flat buffers, in place and in slices.

Given the averaged pseudo-gradient Δ (θ_g − θ_l, so it points downhill like a gradient), one
step is buf ← μ·buf + Δ; θ_g ← θ_g − lr·(Δ + μ·buf): the rule of `torch.optim.SGD(nesterov=True)`
with the same element-wise kernels in the same order (its single-tensor path), so the result
is bit for bit torch's (tests/test_ops.py checks it). It is written out rather than driven
through torch's optimizer because that one allocates Δ + μ·buf whole for the step (4 bytes
per parameter more at the moment of the outer step, on a node whose memory is mostly these
flat buffers) and wants a parameter of its own to hang the state on; here the temporary is one
slice. The momentum buffer is a tensor this class owns (checkpointed, averaged in a re-sync).
Peers that enter with identical θ_g, momentum and Δ leave with identical θ_g.
"""

from __future__ import annotations

import torch

from .coded import CodedDelta

STEP_SLICE = 1 << 20  # values per slice of a step: the one temporary is this long


class NesterovOuterOptimizer:
    def __init__(
        self,
        numel: int,
        lr: float = 0.7,
        momentum: float = 0.9,
        device: str | torch.device = "cpu",
        step_slice: int = STEP_SLICE,
    ):
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError("outer lr must be > 0 and momentum in [0, 1)")
        if step_slice < 1:
            raise ValueError("step_slice must be >= 1")
        self.lr = lr
        self.momentum = momentum
        self.step_slice = step_slice
        # without momentum (plain SGD) there is no buffer: an empty one, not 4 bytes per parameter of zeros
        self.momentum_buffer = torch.zeros(numel if momentum > 0 else 0, dtype=torch.float32, device=device)

    @torch.no_grad()
    def step(self, params: torch.Tensor, pseudo_gradient: torch.Tensor | CodedDelta) -> None:
        """θ_g (`params`) ← one step along Δ (`pseudo_gradient`, read only; a coded one is
        decoded a slice at a time). With μ = 0 it is θ_g ← θ_g − lr·Δ (torch refuses Nesterov
        without momentum; there is no buffer)."""
        self.step_range(params, pseudo_gradient, 0, params.numel())

    @torch.no_grad()
    def step_range(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor | CodedDelta, start: int, stop: int
    ) -> None:
        """`step` on values [start, stop) only (element-wise: steps over ranges that cover the
        buffers once are one step, bit for bit). Lets a caller move θ_l along with θ_g a span at
        a time, with no model-sized copy of either (Replica.land)."""
        n = params.numel()
        if (
            params.dim() != 1
            or pseudo_gradient.numel() != n
            or (self.momentum > 0 and params.shape != self.momentum_buffer.shape)
        ):
            raise ValueError("outer step buffers differ in shape")
        if not 0 <= start <= stop <= n:
            raise ValueError(f"range [{start}, {stop}) is not within {n} values")
        width = self.step_slice
        if isinstance(pseudo_gradient, CodedDelta):  # slices of whole blocks, where the range starts on one
            width = max(width // pseudo_gradient.block_size, 1) * pseudo_gradient.block_size
        scratch = torch.empty(min(stop - start, width), dtype=params.dtype, device=params.device)
        for at in range(start, stop, width):
            end = min(at + width, stop)
            theta = params[at:end]
            if isinstance(pseudo_gradient, CodedDelta):
                delta = pseudo_gradient.values(at, end).to(params.device)
            else:
                delta = pseudo_gradient[at:end]
            if self.momentum == 0:
                theta.add_(delta, alpha=-self.lr)
                continue
            buf = self.momentum_buffer[at:end]
            buf.mul_(self.momentum).add_(delta)
            nesterov = torch.add(delta, buf, alpha=self.momentum, out=scratch[: theta.numel()])
            theta.add_(nesterov, alpha=-self.lr)

    @torch.no_grad()
    def step_norm_bound(self, pseudo_gradient: torch.Tensor | CodedDelta) -> torch.Tensor:
        """An upper bound on how far the last `step` moved θ_g: lr·(‖Δ‖ + μ·‖buf‖) ≥ ‖lr·(Δ + μ·buf)‖
        (for plain SGD, μ = 0, it is exact). A 0-d tensor on the buffers' device, so a caller on
        CUDA does not wait for it until it reads it; two passes over flat buffers, no copy."""
        if isinstance(pseudo_gradient, CodedDelta):
            bound = pseudo_gradient.norm().to(self.momentum_buffer.device)
        else:
            bound = torch.linalg.vector_norm(pseudo_gradient)
        if self.momentum > 0:
            bound = bound + self.momentum * torch.linalg.vector_norm(self.momentum_buffer)
        return self.lr * bound

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"outer_momentum": self.momentum_buffer}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The momentum of a checkpoint. An empty one (a checkpoint of a swarm without momentum)
        starts it at zero; without momentum any is ignored (a checkpoint written before plain
        SGD dropped its buffer of zeros)."""
        src = state["outer_momentum"]
        if self.momentum == 0:
            return
        if src.numel() == 0:
            self.momentum_buffer.zero_()
            return
        if src.shape != self.momentum_buffer.shape or src.dtype != torch.float32:
            raise ValueError("outer momentum buffer has the wrong shape or dtype")
        self.momentum_buffer.copy_(src)
