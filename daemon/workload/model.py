"""The built-in workload's model: a small GPT-style decoder in plain torch.

Presets span CI (`tiny`, ~0.1M parameters, trains in seconds on a CPU) to a GPU host
(`base`, ~124M). The presets' architecture is GPT-2's (learned positions, pre-LayerNorm,
exact GELU, tied embeddings), so `dtnode export` writes them as a `transformers` GPT-2 model.
They stay plain torch rather than `transformers` models because importing `transformers`
costs about 3 s of a joiner's start-up on a 2-core host and its Llama trains 3-10% slower
here (measured against this model at the tiny and small sizes).

Other models: `hf:PATH` builds a `transformers` causal LM from a local directory (see
workload/hf_model.py); `module:factory` calls a factory returning an nn.Module that maps int64 tokens
[B, T] to logits [B, T, vocab_size] and has the attributes `vocab_size` and `context_length`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import nn

from dtnode.daemon.config.presets import HF_PREFIX, PRESETS, GPTConfig


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

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
            if name.endswith(("proj.weight", "mlp.2.weight")):
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
    model: nn.Module
    if spec in PRESETS:
        model = GPT(PRESETS[spec])
        description = {"preset": spec, **asdict(PRESETS[spec])}
    elif spec.startswith(HF_PREFIX):
        from dtnode.daemon.workload.hf_model import load_hf_model, resolve_hf_source

        model, description = load_hf_model(resolve_hf_source(spec[len(HF_PREFIX) :]))
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
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        description["frozen"] = frozen
    return model, description


def vocab_and_context(model: nn.Module) -> tuple[int, int]:
    """The vocabulary size and context length every dtnode model carries (checked at build)."""
    vocab, context = getattr(model, "vocab_size", None), getattr(model, "context_length", None)
    if not isinstance(vocab, int) or not isinstance(context, int):
        raise TypeError("the model needs integer attributes 'vocab_size' and 'context_length'")
    return vocab, context


def export_format(description: dict) -> str:
    """What `dtnode export` writes for this model: a transformers architecture, or raw weights."""
    if "preset" in description:
        return "transformers:gpt2"
    if "hf" in description:
        return f"transformers:{description['hf'].get('model_type', 'unknown')}"
    return "safetensors-state-dict"


def model_from_description(description: dict, seed: int) -> nn.Module:
    """Rebuild a model of a checkpoint's description (export): a preset or an hf: architecture,
    initialised from `seed` as the swarm's was; a checkpoint's θ_g then overwrites what was trained."""
    torch.manual_seed(seed)
    if "preset" in description:
        fields = {k: description[k] for k in GPTConfig.__dataclass_fields__}
        return GPT(GPTConfig(**fields))
    if "hf" in description:
        from dtnode.daemon.workload.hf_model import hf_model_from_description

        return hf_model_from_description(description)
    raise ValueError(f"a {description.get('factory', 'module:factory')} model cannot be rebuilt from its checkpoint")


def config_hash(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
