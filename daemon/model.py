"""The built-in workload's model: a small GPT-style decoder in plain torch.

Presets span CI (`tiny`, ~0.1M parameters, trains in seconds on a CPU) to a GPU host
(`base`, ~124M). A user model comes from `module:factory`: a callable returning an
nn.Module that maps int64 tokens [B, T] to logits [B, T, vocab_size] and has the attributes
`vocab_size` and `context_length`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_SIZE = 256  # byte-level tokens, for the synthetic language and text files alike


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


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.context_length = cfg.context_length
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context_length, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: fewer parameters to average
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(spec: str, seed: int) -> tuple[nn.Module, dict]:
    """Create the model with seeded (hence swarm-identical) initial weights.

    Returns the model and a JSON-able description whose hash peers compare before they
    average: two peers with different models must never share a group.
    """
    torch.manual_seed(seed)
    if spec in PRESETS:
        model = GPT(PRESETS[spec])
        description = {"preset": spec, **asdict(PRESETS[spec])}
    else:
        module_name, _, factory_name = spec.partition(":")
        factory = getattr(importlib.import_module(module_name), factory_name)
        model = factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
        for attr in ("vocab_size", "context_length"):
            if not isinstance(getattr(model, attr, None), int):
                raise TypeError(f"{spec}: the model needs an integer attribute {attr!r}")
        description = {"factory": spec, "vocab_size": model.vocab_size, "context_length": model.context_length}
    description["parameters"] = [[n, list(p.shape)] for n, p in model.named_parameters()]
    return model, description


def config_hash(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
