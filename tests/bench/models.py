"""Models sized for benchmarks (`--model tests.bench.models:FACTORY`): a checkpoint holds
θ_g and the outer momentum, 8 bytes per parameter."""

from __future__ import annotations

import torch
from torch import nn


class ByteMLP(nn.Module):
    """Embedding, `depth` square layers, output head: just enough to train on bytes."""

    vocab_size = 256
    context_length = 64

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(self.vocab_size, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, self.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return self.head(x)


def mlp_10mb() -> nn.Module:
    return ByteMLP(512, 4)  # 1.25 M parameters: a 10 MB checkpoint


def mlp_100mb() -> nn.Module:
    return ByteMLP(1024, 12)  # 12.9 M parameters: a 103 MB checkpoint
