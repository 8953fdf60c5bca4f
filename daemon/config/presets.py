"""The built-in model presets and the names a --model value is checked against, without torch.

Settings validate --model with these; keeping them apart from the model's torch code lets
`dtnode --help` and a bad flag answer in half a second instead of after a 3-second torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

VOCAB_SIZE = 256  # byte-level tokens, for the synthetic language and text files alike
HF_PREFIX = "hf:"


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = VOCAB_SIZE
    context_length: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(context_length=64, d_model=64, n_layers=2, n_heads=4),
    "small": GPTConfig(context_length=256, d_model=512, n_layers=8, n_heads=8),
    "base": GPTConfig(context_length=1024, d_model=896, n_layers=13, n_heads=14),
}
