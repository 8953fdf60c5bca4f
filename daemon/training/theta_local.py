"""θ_l as the replica reads and writes it: span by span of the flat layout.

The replica's work on θ_l is element-wise (Δ = θ_g − θ_l, θ_l ← θ_g, θ_l ← θ_g − the Δ in
flight, ...), so it never needs θ_l whole in one buffer, only each span of it in turn. On one
device, and on a host of DDP replicas, the trainer's flat buffer is θ_l, and the one span is
all of it (`FlatLocal`). A sharded host (--shard) keeps θ_l only in its ranks' shards; its
spans are the parameters, each gathered from the shards (a read) or sent to them (a write) in
turn, so rank 0 holds one parameter of θ_l at a time rather than a whole host copy
(`sharded.HostShards`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

# what the replica does with each span: its slice of the flat layout, and θ_l's values there
# (a read: current values, read only; a write: the buffer to fill with the new ones)
SpanWork = Callable[[slice, torch.Tensor], object]

ADD_SLICE = 1 << 20  # values per span of `FlatLocal.add`


class LocalWeights(Protocol):
    numel: int  # values in the flat layout
    span_device: torch.device  # where the spans are handed over, and where θ_g lives beside them

    def read(self, work: SpanWork) -> None:
        """`work(span, values)` for every span of θ_l, in order; `values` must not be kept."""

    def write(self, work: SpanWork) -> None:
        """θ_l ← what `work(span, out)` writes into `out`, for every span, in order. `out`
        holds no defined values: a change that needs the old θ_l reads it first (`read`)."""

    def add(self, work: SpanWork) -> None:
        """θ_l += what `work(span, out)` writes into `out`, for every span, in order (`out`
        holds no defined values). One pass that needs no θ_l on the caller's side: a change
        by an amount known span by span (Replica.land) holds no model-sized buffer for it."""


class FlatLocal:
    """θ_l in the trainer's one flat buffer: one span. A write flags it for the host's other
    DDP ranks, which get it before their next inner step."""

    def __init__(self, flat: torch.Tensor, written: Callable[[], None]):
        self.flat = flat
        self.numel = flat.numel()
        self.span_device = flat.device
        self._written = written

    def read(self, work: SpanWork) -> None:
        work(slice(0, self.numel), self.flat)

    def write(self, work: SpanWork) -> None:
        work(slice(0, self.numel), self.flat)
        self._written()

    def add(self, work: SpanWork) -> None:
        """In spans of ADD_SLICE values: the one temporary is a span."""
        scratch = torch.empty(min(self.numel, ADD_SLICE), dtype=self.flat.dtype, device=self.flat.device)
        for start in range(0, self.numel, ADD_SLICE):
            span = slice(start, min(start + ADD_SLICE, self.numel))
            out = scratch[: span.stop - span.start]
            work(span, out)
            self.flat[span].add_(out)
        self._written()
