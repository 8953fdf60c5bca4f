"""`--precision`: the arithmetic of the inner steps' forward and backward passes.

The weights (θ_l, θ_g), the AdamW state and everything peers exchange stay fp32 whatever this
says: only the matrix products of a step run in bf16 or fp16 under autocast. bf16 keeps fp32's
range and needs no care; a V100 or a T4 has no bf16, and fp16's range is too narrow for raw
gradients, so fp16 scales the loss up and the gradients back down with torch's dynamic
GradScaler (a step whose gradients overflowed is skipped, and the scale shrinks).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from enum import StrEnum

import torch


class Precision(StrEnum):
    AUTO = "auto"
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    def resolve(self, device: torch.device) -> Precision:
        """What `auto` means on this device: bf16 on a GPU that has it, fp16 on an older GPU,
        fp32 elsewhere (a CPU's bf16 is emulated on most hosts, slower than fp32)."""
        if self != Precision.AUTO:
            return self
        if device.type == "cuda":
            return Precision.BF16 if torch.cuda.is_bf16_supported() else Precision.FP16
        return Precision.FP32

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(self)


class StepPrecision:
    """One rank's autocast and, for fp16, its loss scaler. Ranks of a DDP host each hold one:
    their gradients are all-reduced before the scaler looks, so they skip the same steps."""

    def __init__(self, precision: Precision, device: torch.device):
        self.precision = precision.resolve(device)
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if self.precision == Precision.FP16 else None

    def autocast(self) -> AbstractContextManager:
        dtype = self.precision.autocast_dtype
        return nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def backward_and_step(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        parameters: list[torch.nn.Parameter],
        grad_clip: float,
    ) -> None:
        if self.scaler is None:
            loss.backward()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
            optimizer.step()
            return
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(optimizer)  # the clip sees true gradient norms
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
        self.scaler.step(optimizer)  # skipped when a gradient overflowed
        self.scaler.update()
