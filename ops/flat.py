"""One flat fp32 buffer behind all averaged tensors of a model.

Packing the parameters into one contiguous buffer makes the pseudo-gradient a single
subtraction and lets the network layer ship one buffer instead of one RPC per tensor.
Parameters become views into the buffer, so the inner optimizer keeps working unchanged.

The buffer holds the trainable parameters first (the region the inner optimizer's state
covers), then any learned buffers the caller adds (a norm's running
statistics): those are averaged with the rest but have no optimizer state. Frozen
parameters are not given: nothing changes them, so there is nothing to average.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch


class FlatParameters:
    """Re-points every parameter's storage into one flat buffer (in a fixed order)."""

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        named_buffers: Iterable[tuple[str, torch.Tensor]] = (),
    ) -> None:
        params: list[tuple[str, torch.Tensor]] = [(name, p) for name, p in named_parameters if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters")
        params += list(named_buffers)
        device = params[0][1].device
        self.names = [name for name, _ in params]
        self.shapes = [tuple(p.shape) for _, p in params]
        self.numel = sum(p.numel() for _, p in params)
        self.buffer = torch.empty(self.numel, dtype=torch.float32, device=device)
        offset = 0
        self.offsets: list[int] = []
        for _, p in params:
            n = p.numel()
            view = self.buffer[offset : offset + n].view_as(p)
            view.copy_(p.detach())
            p.data = view
            self.offsets.append(offset)
            offset += n

    def release(self) -> None:
        """Drop the buffer (a sharded host, once its first values are in the shards); the
        layout (names, shapes, offsets) stays."""
        self.buffer = torch.empty(0, dtype=torch.float32, device=self.buffer.device)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of another flat buffer laid out like this one."""
        if flat.numel() != self.numel:
            raise ValueError(f"flat buffer has {flat.numel()} values, expected {self.numel}")
        return {
            name: flat[off : off + math.prod(shape)].view(shape)
            for name, shape, off in zip(self.names, self.shapes, self.offsets)
        }

    def unflatten_into(self, tensors: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
        """Copy named tensors into `flat`; names, shapes and dtypes must match exactly."""
        if set(tensors) != set(self.names):
            missing = sorted(set(self.names) - set(tensors))
            extra = sorted(set(tensors) - set(self.names))
            raise ValueError(f"parameter names differ (missing {missing[:3]}, unexpected {extra[:3]})")
        for name, view in self.views(flat).items():
            src = tensors[name]
            if tuple(src.shape) != tuple(view.shape) or src.dtype != torch.float32:
                raise ValueError(f"{name}: expected float32{list(view.shape)}, got {src.dtype}{list(src.shape)}")
            view.copy_(src)


def flat_names(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], named_buffers: Iterable[tuple[str, torch.Tensor]] = ()
) -> list[str]:
    """The names FlatParameters would lay out, in its order, without building the buffer."""
    return [name for name, p in named_parameters if p.requires_grad] + [name for name, _ in named_buffers]


def sha256_of(flat: torch.Tensor) -> str:
    """Hash of the raw bytes of a flat fp32 tensor: equal hashes mean bit-identical weights.
    A CPU fp32 tensor is read in place (no bytes copy of the model's size)."""
    data = flat.detach().to("cpu", torch.float32).contiguous()
    return hashlib.sha256(data.numpy().data.cast("B")).hexdigest()
