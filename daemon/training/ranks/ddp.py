"""The DDP side of a host's local ranks: every rank holds all of θ_l and its own AdamW state,
kept equal to rank 0's by identical steps (the FSDP side, under --shard, is fsdp.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtnode.daemon.training.inner_state import flat_moments, install_inner_state, ordered_parameters
from dtnode.daemon.training.ranks.host import FlatMoments, LocalRanks
from dtnode.ops.flat import FlatParameters


def ddp_replica(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A rank's model behind DDP (every rank wraps its replica at the same point: DDP's
    constructor is a collective that also copies rank 0's weights to the others)."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)


@dataclass
class ReplicatedRanks:
    """DDP ranks: each holds all of θ_l and its own AdamW state, kept equal to rank 0's by
    identical steps; rank 0 sends them θ_l or the moments only when those changed otherwise."""

    ranks: LocalRanks
    flat: FlatParameters
    model: torch.nn.Module
    evaluates_together: bool = False  # rank 0 holds the whole model: it evaluates alone

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Rank 0's model behind DDP, on its device."""
        return ddp_replica(model, self.ranks.plan.devices[0])

    def push_params(self) -> None:
        with self.ranks.collective():
            self.ranks.send_params(self.flat.buffer)

    def push_inner(self, optimizer: torch.optim.Optimizer) -> None:
        with self.ranks.collective():
            self.ranks.send_inner(*self.gather_inner(optimizer))

    def gather_inner(self, optimizer: torch.optim.Optimizer) -> FlatMoments:
        return flat_moments(optimizer, ordered_parameters(self.model), self.flat.numel)

    def load_inner(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, moments: FlatMoments) -> None:
        install_inner_state(optimizer, model, *moments)

    def eval_tokens(self, eval_set: torch.Tensor) -> torch.Tensor:
        return eval_set
