"""Training data: a synthetic language with a known loss floor, or text files; and held-out text.

The synthetic language is a random first-order Markov chain over bytes, seeded by the run
id: every token has a few possible successors with Dirichlet-drawn probabilities. Its
entropy rate is the best achievable cross-entropy, so "loss falls toward the floor" is a
check anyone can make. Every peer draws its own stream (seeded by its peer id).

The eval loss must measure generalisation, so it never reads training data. A text file's
eval set comes from `--eval-data`, or else from the file's last `--eval-fraction` bytes,
which training never samples (a tail split, like most language-model recipes: the held-out
part is contiguous text, not windows that overlap training ones). The eval set is the same
fixed windows on every peer, so their losses are comparable; the synthetic language's eval
set is a separate seeded sample of the chain.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .model import VOCAB_SIZE
from .settings import SettingsError


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

    def eval_set(self, count: int, length: int, run_id: str) -> torch.Tensor:
        return self.sample(count, length, torch.Generator().manual_seed(stable_seed(run_id, "eval")))


class TextFile:
    """Byte-level tokens of a UTF-8 text file (or a byte range of one), read through a memory map."""

    entropy_rate = None

    def __init__(self, path: Path, data: np.ndarray | None = None):
        self.path = path
        self.data = np.memmap(path, dtype=np.uint8, mode="r") if data is None else data
        if len(self.data) < 2:
            raise ValueError(f"{path} holds fewer than 2 bytes")

    def __len__(self) -> int:
        return len(self.data)

    def held_out(self, fraction: float) -> tuple["TextFile", "TextFile"]:
        """(training part, held-out tail): the last `fraction` of the bytes, never sampled for training."""
        cut = len(self.data) - max(2, round(len(self.data) * fraction))
        if cut < 2:
            raise ValueError(f"{self.path} is too short to hold out {fraction:g} of it")
        return TextFile(self.path, self.data[:cut]), TextFile(self.path, self.data[cut:])

    def sample(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
        length = min(length, len(self.data))
        starts = torch.randint(0, len(self.data) - length + 1, (batch,), generator=gen).tolist()
        return torch.from_numpy(np.stack([self.data[s : s + length] for s in starts]).astype(np.int64))

    def eval_set(self, count: int, length: int, run_id: str) -> torch.Tensor:
        """`count` windows spread evenly over the text (fewer when it is short): the same on every peer."""
        length = min(length, len(self.data))
        span = len(self.data) - length
        starts = sorted({round(i * span / max(count - 1, 1)) for i in range(count)})
        return torch.from_numpy(np.stack([self.data[s : s + length] for s in starts]).astype(np.int64))


Source = MarkovLanguage | TextFile


@dataclass
class DataSources:
    """Where training batches and the eval set come from; `eval` is None when there is no held-out text."""

    train: Source
    eval: Source | None

    @property
    def loss_floor(self) -> float | None:
        return self.train.entropy_rate


def open_sources(run_id: str, seed: int, data: Path | None, eval_data: Path | None = None,
                 eval_fraction: float = 0.0, seq_len: int = 2) -> DataSources:
    """The node's data; a SettingsError names the option to change when the files cannot serve."""
    if data is None:
        if eval_data is not None:
            raise SettingsError("--eval-data", "needs --data: the synthetic language has its own eval set")
        language = MarkovLanguage(stable_seed(run_id, seed, "language"))
        return DataSources(language, language)
    try:
        train = TextFile(data)
    except ValueError as e:
        raise SettingsError("--data", str(e)) from None
    if eval_data is not None:
        try:
            held_out = TextFile(eval_data)
        except ValueError as e:
            raise SettingsError("--eval-data", str(e)) from None
        if data.resolve() == eval_data.resolve():
            raise SettingsError("--eval-data", f"{eval_data} is the training file itself")
        return DataSources(train, held_out)
    if eval_fraction == 0:
        return DataSources(train, None)
    try:
        train, held_out = train.held_out(eval_fraction)
    except ValueError as e:
        raise SettingsError("--eval-fraction", str(e)) from None
    if len(held_out) < seq_len + 1 or len(train) < seq_len + 1:
        raise SettingsError("--eval-fraction", f"{data} split {len(train)}/{len(held_out)} bytes (train/held out) "
                                               f"leaves a part shorter than one sequence ({seq_len + 1} bytes); "
                                               f"change --eval-fraction or give --eval-data")
    return DataSources(train, held_out)


class DataStream:
    """This peer's endless stream of training batches, plus the swarm-wide eval set."""

    def __init__(self, sources: DataSources, run_id: str, peer_id: str, batch_size: int, seq_len: int,
                 eval_sequences: int = 64):
        self.source = sources.train
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(stable_seed(run_id, "train", peer_id))
        self.eval_set = (sources.eval.eval_set(eval_sequences, seq_len + 1, run_id)
                         if sources.eval is not None and eval_sequences else None)
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
