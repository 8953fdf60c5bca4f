"""Training data: a synthetic language with a known loss floor, or a token corpus (workload/corpus.py); and held-out text.

The synthetic language is a random first-order Markov chain over bytes, seeded by the run
id: every token has a few possible successors with Dirichlet-drawn probabilities. Its
entropy rate is the best achievable cross-entropy, so "loss falls toward the floor" is a
check anyone can make. Every peer draws its own stream (seeded by its peer id).

The eval loss must measure generalisation, so it never reads training data. Real data's
eval set comes from `--eval-data`, or else from held-out documents of `--data` (of a single
file: its last `--eval-fraction` of tokens), which training never reads; see workload/corpus.py. The
eval set is the same fixed windows on every peer, so their losses are comparable; the
synthetic language's eval set is a separate seeded sample of the chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dtnode.daemon.config.presets import VOCAB_SIZE
from dtnode.daemon.config.settings import SettingsError
from dtnode.daemon.workload.corpus import CorpusError, CorpusReader, TokenCorpus, stable_seed
from dtnode.daemon.workload.sources import open_corpus
from dtnode.daemon.workload.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["DataSources", "DataStream", "MarkovLanguage", "check_token_ids", "open_sources", "stable_seed"]


class MarkovLanguage:
    def __init__(self, seed: int, vocab_size: int = VOCAB_SIZE, successors: int = 6, concentration: float = 0.6):
        rng = np.random.default_rng(seed)
        table = np.zeros((vocab_size, vocab_size))
        for state in range(vocab_size):
            successors_of_state = rng.choice(vocab_size, size=successors, replace=False)
            table[state, successors_of_state] = rng.dirichlet(np.full(successors, concentration))
        transitions = torch.from_numpy(table)
        self.vocab_size = vocab_size
        self.transitions = transitions
        self.cumulative = transitions.cumsum(1).float()
        self.cumulative[:, -1] = 1.0
        self._level_values, self._level_tokens = _levels(self.cumulative.numpy())
        # the chain's long-run distribution: the uniform one after 2**11 steps, by squaring the
        # transition matrix 11 times. Not 2000 vector-matrix products: each is a tiny parallel
        # op, and where a host's processes outnumber its cores (a test's swarm on 2 cores) their
        # threads' barriers turned this 0.02 s into 10-30 s of a joiner's start
        power = transitions
        for _ in range(11):
            power = power @ power
        stationary = torch.full((vocab_size,), 1.0 / vocab_size, dtype=torch.float64) @ power
        self.stationary = stationary / stationary.sum()

    @property
    def entropy_rate(self) -> float:
        """Nats per token: the loss of a perfect model."""
        p = self.transitions
        row_entropy = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(1)
        return float((self.stationary * row_entropy).sum())

    def sample(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
        """`batch` sequences of `length` tokens. Token t+1 is the first token whose cumulative
        probability after token t reaches a uniform draw, found among the few places where that
        row of the cumulative table rises (`_levels`) rather than in the whole row: the same
        tokens as a search of the whole row (a test holds them equal), 6x as fast for 16 x 1025
        tokens. On a GPU host this sampling, one position at a time, is most of the trainer's CPU
        work beside a step: the whole-row search held an H200's `base` steps to 296k tokens/s."""
        tokens = np.empty((length, batch), dtype=np.int64)
        tokens[0] = torch.multinomial(self.stationary.float(), batch, replacement=True, generator=gen).numpy()
        draws = torch.rand(length, batch, 1, generator=gen).numpy()
        values, levels = self._level_values, self._level_tokens
        for t in range(1, length):
            previous = tokens[t - 1]
            rank = (values[previous] < draws[t]).sum(1)  # levels below the draw: the first one reaching it
            tokens[t] = levels[previous, rank]
        return torch.from_numpy(np.ascontiguousarray(tokens.T))

    def eval_set(self, count: int, length: int, run_id: str) -> torch.Tensor:
        return self.sample(count, length, torch.Generator().manual_seed(stable_seed(run_id, "eval")))


def _levels(cumulative: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of a cumulative table as its levels: the values it takes and the first token of
    each (token 0, and every token where the row rises), padded with 2.0, which no draw in [0, 1)
    exceeds. The first token whose value reaches a draw is the first token of the first level
    that does: `levels[rank]`, where rank counts the levels below the draw."""
    rises = np.ones_like(cumulative, dtype=bool)
    rises[:, 1:] = cumulative[:, 1:] > cumulative[:, :-1]
    width = int(rises.sum(1).max())
    values = np.full((len(cumulative), width), 2.0, dtype=cumulative.dtype)
    tokens = np.zeros((len(cumulative), width), dtype=np.int64)
    for state, row in enumerate(rises):
        starts = np.flatnonzero(row)
        values[state, : len(starts)] = cumulative[state, starts]
        tokens[state, : len(starts)] = starts
    return values, tokens


Source = MarkovLanguage | TokenCorpus


@dataclass
class DataSources:
    """Where training batches and the eval set come from; `eval` is None when there is no held-out text."""

    train: Source
    eval: Source | None

    @property
    def loss_floor(self) -> float | None:
        return self.train.entropy_rate


def open_sources(
    run_id: str,
    seed: int,
    data: Path | None,
    eval_data: Path | None = None,
    eval_fraction: float = 0.0,
    seq_len: int = 2,
    *,
    tokenizer: Tokenizer | None = None,
    text_field: str = "text",
    data_dtype: str = "auto",
    cache_dir: Path | None = None,
) -> DataSources:
    """The node's data; a SettingsError names the option to change when the files cannot serve.

    `cache_dir` holds token files made from text (the state dir's `data-cache`)."""
    if data is None:
        if eval_data is not None:
            raise SettingsError("--eval-data", "needs --data: the synthetic language has its own eval set")
        language = MarkovLanguage(stable_seed(run_id, seed, "language"))
        return DataSources(language, language)
    splitter: Tokenizer = tokenizer or ByteTokenizer()
    cache_dir = cache_dir or data.parent / ".dtnode-token-cache"
    if eval_data is not None and data.resolve() == eval_data.resolve():
        raise SettingsError("--eval-data", f"{eval_data} is the training data itself")
    fraction = 0.0 if eval_data is not None else eval_fraction
    try:
        train, held_out = open_corpus(data, splitter, text_field, data_dtype, cache_dir, fraction, seq_len + 1)
    except CorpusError as e:
        raise SettingsError("--data", str(e)) from None
    if eval_data is not None:
        try:
            held_out = open_corpus(eval_data, splitter, text_field, data_dtype, cache_dir)[0]
        except CorpusError as e:
            raise SettingsError("--eval-data", str(e)) from None
        if len(held_out) < seq_len + 1:
            raise SettingsError(
                "--eval-data", f"{eval_data} holds {len(held_out)} tokens, fewer than one sequence ({seq_len + 1})"
            )
    if len(train) < seq_len + 1:
        raise SettingsError(
            "--data",
            f"{data} holds {len(train)} training tokens, fewer than one sequence "
            f"({seq_len + 1}); give more data or a shorter --seq-len",
        )
    return DataSources(train, held_out)


def check_token_ids(corpus: TokenCorpus, vocab_size: int, option: str) -> None:
    """Every id must index the model's embedding; a corpus of unknown origin (.bin) is scanned once."""
    if corpus.id_bound is not None and corpus.id_bound <= vocab_size:
        return
    if (top := corpus.max_id()) >= vocab_size:
        raise SettingsError(
            option,
            f"{corpus.name} holds token id {top}, outside the model's vocabulary of "
            f"{vocab_size} (wrong --data-dtype, or data made for another tokenizer?)",
        )


class DataStream:
    """This peer's endless stream of training batches, plus the swarm-wide eval set.

    The synthetic language is sampled (its own seeded chain per peer); a corpus is read in
    order (CorpusReader), so the stream's position is the count of batches drawn."""

    def __init__(
        self, sources: DataSources, run_id: str, peer_id: str, batch_size: int, seq_len: int, eval_sequences: int = 64
    ):
        self.source = sources.train
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(stable_seed(run_id, "train", peer_id))
        self.reader = (
            CorpusReader(self.source, seq_len + 1, run_id, peer_id) if isinstance(self.source, TokenCorpus) else None
        )
        self.eval_set = (
            sources.eval.eval_set(eval_sequences, seq_len + 1, run_id)
            if sources.eval is not None and eval_sequences
            else None
        )
        self.sequences_drawn = 0  # counted in sequences, not batches: a node restarted with another
        # rank count (another batch) goes on from the same place in its corpus
        self._ahead: tuple[torch.Tensor, torch.Tensor] | None = None  # (generator state before it, batch)

    def next_batch(self) -> torch.Tensor:
        """[B, seq_len + 1] tokens: inputs are [:, :-1], targets [:, 1:]."""
        first = self.sequences_drawn
        self.sequences_drawn += self.batch_size
        ahead, self._ahead = self._ahead, None
        return ahead[1] if ahead is not None else self._draw(first)

    def prefetch(self) -> None:
        """Draw the next batch now, while a GPU computes the current step: sampling the synthetic
        language for a batch of 16 x 1025 tokens takes 23 ms of CPU (measured on an H100 host),
        a third of the `base` preset's step there. The stream's position stays before it, so a
        checkpoint taken in between resumes with this very batch."""
        if self._ahead is None:
            state = self.gen.get_state()
            self._ahead = (state, self._draw(self.sequences_drawn))

    def _draw(self, first: int) -> torch.Tensor:
        if self.reader is not None:
            return self.reader.batch(first, self.batch_size)
        assert isinstance(self.source, MarkovLanguage)  # a token corpus always has a reader
        return self.source.sample(self.batch_size, self.seq_len + 1, self.gen)

    def position(self) -> tuple[torch.Tensor, int]:
        """Where this stream is: its generator state and the sequences drawn so far (a batch
        drawn ahead is not drawn yet)."""
        ahead = self._ahead
        return (ahead[0] if ahead is not None else self.gen.get_state()), self.sequences_drawn

    def seek(self, generator_state: torch.Tensor, sequences_drawn: int) -> None:
        """Continue exactly where a saved position left off (this peer's own stream only)."""
        self._ahead = None
        self.gen.set_state(generator_state.to(torch.uint8).contiguous())
        self.sequences_drawn = sequences_drawn
