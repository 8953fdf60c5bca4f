"""Models from Hugging Face `transformers`: a local directory, or a Hub id through the Hub cache.

`--model hf:PATH` names a directory holding a `config.json` and, optionally, safetensors
weights. `--model hf:ORG/NAME` (or `hf:NAME`, `hf:ORG/NAME@REVISION`) names a model on the
Hugging Face Hub: `huggingface_hub` fetches its config, safetensors weights and tokenizer files
into its cache (HF_HOME), or with HF_HUB_OFFLINE=1 takes them from there without a network. With the config alone the model starts from a seeded initialisation, the same on
every peer; with weights it starts from them (continued pre-training or fine-tuning). Only
safetensors weights are read: a `pytorch_model.bin` is a pickle, and pickles from a model
someone handed over are code, not data.

The model is wrapped so that the trainer sees what every dtnode model is: tokens [B, T] in,
logits [B, T, vocab] out, with `vocab_size` and `context_length`. Its parameters keep their
`transformers` names behind the wrapper's `hf.` prefix, so an export is a rename.

`transformers` is imported here only, and only for `hf:` models: its import costs about 3 s
of start-up on a 2-core host, which a joiner of a preset swarm should not pay.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtnode.daemon.config.model_source import is_hub_id

PREFIX = "hf."  # parameter names of the wrapped model
_VOLATILE_CONFIG_KEYS = (
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "architectures",
    "_commit_hash",
    "_attn_implementation_autoset",
    "use_cache",
)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


class HFModelError(ValueError):
    """A model directory that cannot be used; the message says what to change."""


# What a model and its tokenizer need from a Hub repository; never a pickle
_HUB_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def resolve_hf_source(source: str) -> Path:
    """The local directory of `hf:SOURCE`: the directory itself, or a Hub model's snapshot in
    the Hugging Face cache (fetched there first unless HF_HUB_OFFLINE is set)."""
    if not is_hub_id(source):
        return Path(source).expanduser()
    repo_id, _, revision = source.partition("@")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise HFModelError("hf: models need the Hugging Face libraries: pip install 'dtnode[hf]'") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=list(_HUB_FILES)))
    except LocalEntryNotFoundError:
        raise HFModelError(
            f"{repo_id} is not in the Hugging Face cache ({_cache_dir()}) and the Hub cannot be reached "
            "(HF_HUB_OFFLINE, or no network): fetch it on a connected host, or give hf:DIRECTORY"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise HFModelError(f"cannot fetch {repo_id} from the Hugging Face Hub: {e}") from None


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise HFModelError("hf: models need the Hugging Face libraries: pip install 'dtnode[hf]'") from None
    transformers.logging.set_verbosity_error()  # its warnings about unused weights go to our own checks
    transformers.logging.disable_progress_bar()  # a node's log is one line per event
    return transformers


class CausalLM(nn.Module):
    """A `transformers` causal LM as a dtnode model: tokens in, logits out."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        config: Any = hf_model.config
        self.vocab_size = int(config.vocab_size)
        self.context_length = context_length_of(config.to_dict())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits


def context_length_of(config: dict) -> int:
    for key in _CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 1:
            return value
    raise HFModelError(f"the model config names no context length (one of {', '.join(_CONTEXT_KEYS)})")


def portable_config(config: dict) -> dict:
    """The config without what differs between equal models (library version, local path)."""
    return {k: v for k, v in sorted(config.items()) if k not in _VOLATILE_CONFIG_KEYS}


def weights_sha256(directory: Path) -> str | None:
    """Hash of the safetensors weights in `directory` (None without any): peers that start from
    different weights have different models, whatever their configs say."""
    files = sorted(directory.glob("model*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def load_hf_model(directory: Path) -> tuple[CausalLM, dict]:
    """The wrapped model and its description (config, weights hash); seed torch before calling."""
    if not directory.is_dir():
        raise HFModelError(f"{directory} is not a directory (hf:PATH names a directory with a config.json)")
    if not (directory / "config.json").is_file():
        raise HFModelError(f"{directory} has no config.json")
    has_weights = any((directory / name).is_file() for name in _WEIGHT_FILES)
    if not has_weights and any(directory.glob("pytorch_model*.bin")):
        raise HFModelError(
            f"{directory} holds only pickled weights (pytorch_model.bin); dtnode reads safetensors "
            "only: convert them with save_pretrained(..., safe_serialization=True)"
        )
    transformers = require_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        if has_weights:
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, local_files_only=True, use_safetensors=True, dtype=torch.float32
            )
        else:
            hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise HFModelError(f"cannot build a causal LM from {directory}: {e}") from None
    hf_model.float()
    model = CausalLM(hf_model)
    description = {
        "hf": portable_config(hf_model.config.to_dict()),
        "weights": weights_sha256(directory),
        "vocab_size": model.vocab_size,
        "context_length": model.context_length,
    }
    return model, description


def hf_model_from_description(description: dict) -> CausalLM:
    """Rebuild the wrapped model from a checkpoint's description (no directory needed): the
    architecture, with freshly initialised weights that a checkpoint then overwrites."""
    transformers = require_transformers()
    config_dict = dict(description["hf"])
    model_type = config_dict.pop("model_type", None)
    if not model_type:
        raise HFModelError("the checkpoint's model config has no model_type")
    config = transformers.AutoConfig.for_model(model_type, **config_dict)
    return CausalLM(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).float())
