"""Training data: a synthetic language with a known loss floor, or a text file.

The synthetic language is a random first-order Markov chain over bytes, seeded by the run
id: every token has a few possible successors with Dirichlet-drawn probabilities. Its
entropy rate is the best achievable cross-entropy, so "loss falls toward the floor" is a
check anyone can make. Every peer draws its own stream (seeded by its peer id), while the
evaluation batch is the same on every peer so their losses are comparable.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from .model import VOCAB_SIZE


def stable_seed(*parts: object) -> int:
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class MarkovLanguage:
    def __init__(self, seed: int, vocab_size: int = VOCAB_SIZE, successors: int = 6, concentration: float = 0.6):
        rng = np.random.default_rng(seed)
        transitions = np.zeros((vocab_size, vocab_size))
        for state in range(vocab_size):
            successors_of_state = rng.choice(vocab_size, size=successors, replace=False)
            transitions[state, successors_of_state] = rng.dirichlet(np.full(successors, concentration))
        transitions = torch.from_numpy(transitions)
        self.vocab_size = vocab_size
        self.transitions = transitions
        self.cumulative = transitions.cumsum(1).float()
        self.cumulative[:, -1] = 1.0
        stationary = torch.full((vocab_size,), 1.0 / vocab_size, dtype=torch.float64)
        for _ in range(2000):
            stationary = stationary @ transitions
        self.stationary = stationary / stationary.sum()

    @property
    def entropy_rate(self) -> float:
        """Nats per token: the loss of a perfect model."""
        p = self.transitions
        row_entropy = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(1)
        return float((self.stationary * row_entropy).sum())

    def sample(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
        tokens = torch.empty(batch, length, dtype=torch.int64)
        tokens[:, 0] = torch.multinomial(self.stationary.float(), batch, replacement=True, generator=gen)
        draws = torch.rand(length, batch, 1, generator=gen)
        for t in range(1, length):
            rows = self.cumulative[tokens[:, t - 1]]
            tokens[:, t] = torch.searchsorted(rows, draws[t]).squeeze(1).clamp_max(self.vocab_size - 1)
        return tokens


class TextFile:
    """Byte-level tokens of a UTF-8 text file, read through a memory map."""

    def __init__(self, path: Path):
        data = np.memmap(path, dtype=np.uint8, mode="r")
        if len(data) < 2:
            raise ValueError(f"{path} holds fewer than 2 bytes")
        self.data = data
        self.entropy_rate = None

    def sample(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
        length = min(length, len(self.data))
        starts = torch.randint(0, len(self.data) - length + 1, (batch,), generator=gen).tolist()
        return torch.from_numpy(np.stack([self.data[s : s + length] for s in starts]).astype(np.int64))


class DataStream:
    """This peer's endless stream of training batches, plus the swarm-wide eval batch."""

    def __init__(self, source: MarkovLanguage | TextFile, run_id: str, peer_id: str, batch_size: int, seq_len: int):
        self.source = source
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(stable_seed(run_id, "train", peer_id))
        eval_gen = torch.Generator().manual_seed(stable_seed(run_id, "eval"))
        self.eval_batch = source.sample(64, seq_len + 1, eval_gen)
        self.batches_drawn = 0

    def next_batch(self) -> torch.Tensor:
        """[B, seq_len + 1] tokens: inputs are [:, :-1], targets [:, 1:]."""
        self.batches_drawn += 1
        return self.source.sample(self.batch_size, self.seq_len + 1, self.gen)

    def position(self) -> tuple[torch.Tensor, int]:
        """Where this stream is: its generator state and the batches drawn so far."""
        return self.gen.get_state(), self.batches_drawn

    def seek(self, generator_state: torch.Tensor, batches_drawn: int) -> None:
        """Continue exactly where a saved position left off (this peer's own stream only)."""
        self.gen.set_state(generator_state.to(torch.uint8).contiguous())
        self.batches_drawn = batches_drawn

    @property
    def loss_floor(self) -> float | None:
        return self.source.entropy_rate


def open_source(run_id: str, seed: int, path: Path | None) -> MarkovLanguage | TextFile:
    return TextFile(path) if path else MarkovLanguage(stable_seed(run_id, seed, "language"))
