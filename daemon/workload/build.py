"""What a node trains: the device, the model, its tokenizer and the data, built from the settings.

Everything here is decided before the node joins anything, so a bad `--model`, `--tokenizer`
or `--data` ends the start with one line naming the option (SettingsError), not a traceback
later in a round.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtnode.daemon.config.settings import NodeSettings, SettingsError
from dtnode.daemon.workload.corpus import TokenCorpus
from dtnode.daemon.workload.data import DataSources, check_token_ids, open_sources, stable_seed
from dtnode.daemon.workload.hf_model import HFModelError
from dtnode.daemon.workload.model import HF_PREFIX, build_model, config_hash, export_format, vocab_and_context
from dtnode.daemon.workload.recipe import SwarmRecipe, data_fingerprint, recipe_of
from dtnode.daemon.workload.tokenizer import check_vocabulary, load_tokenizer

TOKEN_CACHE_DIR = "data-cache"  # token files made from text data (workload/corpus.py), reused across restarts


def resolve_device(name: str) -> torch.device:
    """`--device` as a torch device, checked against what this host has."""
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SettingsError("--device", "CUDA is not available on this host")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SettingsError("--device", f"no CUDA device {device.index} (found {torch.cuda.device_count()})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise SettingsError("--device", "MPS is not available on this host")
    return device


@dataclass
class Workload:
    """The model (not yet on its device), what identifies it to peers, and the data."""

    model: torch.nn.Module
    description: dict[str, Any]  # what config_hash covers (the tokenizer's hash included, if any)
    model_hash: str
    seq_len: int
    sources: DataSources
    init_seed: int
    export_format: str
    recipe: SwarmRecipe  # what every peer of the swarm must share (workload/recipe.py)

    def checkpoint_metadata(self, settings: NodeSettings) -> dict[str, str]:
        """The metadata of this run's checkpoints: the same bytes on every peer of a group
        (joiners fetch ranges of one file from several), so no local path: an hf: model is
        named by its kind and its config in `model_config`."""
        model = "hf" if settings.workload.model.startswith(HF_PREFIX) else settings.workload.model
        return {
            "run_id": settings.swarm.run_id,
            "model_hash": self.model_hash,
            "model": model,
            "model_config": json.dumps(self.description, sort_keys=True),
            "init_seed": str(self.init_seed),
            "export_format": self.export_format,
        }


def build_workload(s: NodeSettings, state_dir: Path) -> Workload:
    """Build the model and open the data; SettingsError naming the option when one cannot serve."""
    seed = stable_seed(s.swarm.run_id, s.workload.seed, "init")
    try:
        model, description = build_model(s.workload.model, seed)
    except HFModelError as e:
        raise SettingsError("--model", str(e)) from None
    except (ImportError, AttributeError, TypeError) as e:  # a module:factory that cannot serve
        raise SettingsError("--model", f"cannot build {s.workload.model}: {e}") from None
    vocab_size, context_length = vocab_and_context(model)
    tokenizer = load_tokenizer(s.workload.tokenizer)
    check_vocabulary(tokenizer, vocab_size)
    if s.workload.tokenizer is not None:  # peers that split text differently must not average
        description["tokenizer"] = tokenizer.sha256
    seq_len = min(s.workload.seq_len or context_length, context_length)
    sources = open_sources(
        s.swarm.run_id,
        s.workload.seed,
        s.workload.data,
        s.evaluation.eval_data,
        s.evaluation.eval_fraction,
        seq_len,
        tokenizer=tokenizer,
        text_field=s.workload.text_field,
        data_dtype=s.workload.data_dtype,
        cache_dir=state_dir / TOKEN_CACHE_DIR,
    )
    for source, option in (
        (sources.train, "--data"),
        (sources.eval, "--eval-data" if s.evaluation.eval_data else "--data"),
    ):
        if isinstance(source, TokenCorpus):
            check_token_ids(source, vocab_size, option)
    recipe = recipe_of(s, seq_len, data_fingerprint(sources, s.workload.data, s.workload.seed))
    return Workload(
        model, description, config_hash(description), seq_len, sources, seed, export_format(description), recipe
    )
