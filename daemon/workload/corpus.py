"""Token corpora: every data source becomes one flat array of token ids, memory-mapped (how a
source is opened and tokenized: sources.py).

Sources (`--data`, `--eval-data`):
- a `.bin` of uint16/uint32 ids, nanoGPT style (no header; `--data-dtype`) or llm.c style
  (a 256-int32 header: magic 20240520, version 1 = uint16, 2 = uint32, token count), used
  in place;
- one UTF-8 text file without `--tokenizer`: its bytes are the ids, used in place;
- anything else (text with a tokenizer, a directory of text files, `.jsonl`/`.parquet` read
  through `datasets` in streaming mode, `--text-field`) is tokenized once, document by
  document, into a token file in the state dir (llm.c format), keyed by the sources' names,
  sizes and times, the tokenizer and the split; later starts map that file.

Held-out text never reaches training. With `--eval-data` it is another source. Otherwise a
document is held out when the hash of its name (file, and row number) falls under
`--eval-fraction`: the same documents on every peer, whole documents, never split. A single
text or `.bin` file is one document, so its last `--eval-fraction` of tokens is held out.

Reading order (CorpusReader): the corpus is cut into windows of one sequence; the run's seed
fixes one permutation of them (affine, so it costs no memory for any corpus size), and each
peer reads it in order from an offset derived from its peer id and the run. Peers read
disjoint stretches of one shuffled epoch (each its arc up to the next peer's offset) and no
window twice before the epoch is through; the position is one integer, kept in checkpoints.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
LLMC_VERSIONS = {1: np.uint16, 2: np.uint32}
MAX_HELD_OUT_SHARE = 0.2  # a small dataset's held-out part never takes more of its tokens than this


class CorpusError(ValueError):
    """Data that cannot be read as tokens; the message names the file and what is wrong."""


def stable_seed(*parts: object) -> int:
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TokenCorpus:
    """A flat array of token ids (usually a memory map) with the eval windows drawn from it."""

    entropy_rate = None  # real data has no known floor

    def __init__(self, tokens: np.ndarray, name: str, id_bound: int | None = None):
        if len(tokens) < 2:
            raise CorpusError(f"{name} holds fewer than 2 tokens")
        self.tokens = tokens
        self.name = name
        self.id_bound = id_bound  # every id is below this, when known by construction

    def __len__(self) -> int:
        return len(self.tokens)

    def max_id(self) -> int:
        """The largest id (one pass in chunks: the array may be a memory map of gigabytes)."""
        step = 1 << 24
        return int(max(self.tokens[i : i + step].max() for i in range(0, len(self.tokens), step)))

    def tail_split(self, fraction: float, min_tokens: int = 2) -> tuple[TokenCorpus, TokenCorpus | None]:
        """(training part, held-out tail): the last `fraction` of the tokens, at least `min_tokens`
        (one sequence); None (with a warning) when that would take more than MAX_HELD_OUT_SHARE."""
        n = len(self.tokens)
        tail = max(min_tokens, round(n * fraction))
        if tail > MAX_HELD_OUT_SHARE * n or n - tail < min_tokens:
            log.warning(
                "%s is too short to hold out one sequence (%d tokens) for the eval loss: training without one "
                "(give --eval-data for one)",
                self.name,
                min_tokens,
            )
            return self, None
        cut = n - tail
        return (
            TokenCorpus(self.tokens[:cut], self.name, self.id_bound),
            TokenCorpus(self.tokens[cut:], self.name, self.id_bound),
        )

    def window(self, start: int, length: int) -> np.ndarray:
        return np.asarray(self.tokens[start : start + length], dtype=np.int64)

    def eval_set(self, count: int, length: int, run_id: str) -> torch.Tensor:
        """`count` windows spread evenly over the corpus (fewer when it is short): the same on every peer."""
        length = min(length, len(self.tokens))
        span = len(self.tokens) - length
        starts = sorted({round(i * span / max(count - 1, 1)) for i in range(count)})
        return torch.from_numpy(np.stack([self.window(s, length) for s in starts]))


class CorpusReader:
    """One peer's ordered walk over a corpus's windows (see the module docstring)."""

    def __init__(self, corpus: TokenCorpus, length: int, run_id: str, peer_id: str):
        self.corpus = corpus
        self.length = min(length, len(corpus))
        self.stride = max(self.length - 1, 1)  # a window's last token is the next one's first input
        self.windows = max((len(corpus) - self.length) // self.stride + 1, 1)
        n = self.windows
        self.multiplier = _coprime_near(stable_seed(run_id, "window-order") % n, n) if n > 1 else 1
        self.shift = stable_seed(run_id, "window-shift") % n
        self.offset = stable_seed(run_id, peer_id, "window-offset") % n

    def window_index(self, position: int) -> int:
        """The corpus window this peer reads at `position` (0, 1, ... in its stream)."""
        return (self.multiplier * ((self.offset + position) % self.windows) + self.shift) % self.windows

    def batch(self, first_position: int, batch_size: int) -> torch.Tensor:
        rows = [
            self.corpus.window(self.window_index(first_position + i) * self.stride, self.length)
            for i in range(batch_size)
        ]
        return torch.from_numpy(np.stack(rows))


def _coprime_near(start: int, n: int) -> int:
    """The first multiplier from `start` up that is coprime with n (so i -> a*i mod n is a permutation)."""
    a = max(start, 1)
    while math.gcd(a, n) != 1:
        a += 1
    return a % n or 1


# ---- opening sources ---------------------------------------------------------------------
def cached_tokens(path: Path) -> int:
    """The token count an llm.c header (as the token cache writes it) announces."""
    header = np.fromfile(path, dtype=np.int32, count=3)
    return int(header[2]) if len(header) == 3 and header[0] == LLMC_MAGIC else 0


def read_bin(path: Path, dtype: str = "auto") -> TokenCorpus:
    """A token file in place: llm.c's header when it has one, else raw ids of `dtype` (uint16 by default)."""
    size = path.stat().st_size
    header = np.fromfile(path, dtype=np.int32, count=3) if size >= 4 * LLMC_HEADER_INTS else np.zeros(3, np.int32)
    if header[0] == LLMC_MAGIC:
        version, count = int(header[1]), int(header[2])
        if version not in LLMC_VERSIONS:
            raise CorpusError(f"{path}: llm.c token file of unknown version {version}")
        found = LLMC_VERSIONS[version]
        if dtype != "auto" and np.dtype(dtype) != found:
            raise CorpusError(f"{path}: its header says {np.dtype(found).name}, --data-dtype says {dtype}")
        offset = 4 * LLMC_HEADER_INTS
        if offset + count * np.dtype(found).itemsize > size:
            raise CorpusError(f"{path}: its header promises {count} tokens, the file is shorter (torn?)")
        return TokenCorpus(np.memmap(path, dtype=found, mode="r", offset=offset, shape=(count,)), str(path))
    raw = np.dtype("uint16" if dtype == "auto" else dtype)
    if size % raw.itemsize:
        raise CorpusError(f"{path}: {size} bytes is not a whole number of {raw.name} ids (wrong --data-dtype?)")
    return TokenCorpus(np.memmap(path, dtype=raw, mode="r"), str(path))
