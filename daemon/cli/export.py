"""`dtnode export`: a checkpoint's θ_g as a `save_pretrained` directory.

What a run produces should leave dtnode with no glue code: `AutoModelForCausalLM.from_pretrained(OUT)`
and `AutoTokenizer.from_pretrained(OUT)` load it. The built-in presets are GPT-2's architecture
(workload/model.py) and are written as a GPT-2 model; `hf:` models are written as themselves; a
`module:factory` model (given again with `--model`) as its state dict in `model.safetensors`. The tokenizer
is the run's `--tokenizer`, or for byte-level runs a byte-level tokenizer whose ids are the
bytes, so the exported pair encodes text exactly as training did.

The checkpoint is read as a node reads a peer's: safetensors only, every name, shape and value
checked against the model its own metadata describes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_model

from dtnode.daemon.checkpoints.file_format import (
    CheckpointError,
    Layout,
    file_sha256,
    list_checkpoints,
    read_checkpoint,
    read_metadata,
)
from dtnode.daemon.config.settings import SettingsError
from dtnode.daemon.training.inner_step import learned_buffers
from dtnode.daemon.workload.corpus import stable_seed
from dtnode.daemon.workload.hf_model import CausalLM, require_transformers
from dtnode.daemon.workload.model import GPT, build_model, config_hash, export_format, model_from_description
from dtnode.daemon.workload.remembered import remembered_workload
from dtnode.daemon.workload.tokenizer import EOS_NAMES, LocalTokenizer
from dtnode.ops.flat import FlatParameters

log = logging.getLogger(__name__)

EXPORT_INFO = "dtnode_export.json"


def export_checkpoint(
    state_dir: Path, out: Path, step: int | None = None, tokenizer: Path | None = None, model: str | None = None
) -> Path:
    """Write the export of checkpoint `step` (default: the newest whole one) into `out`; returns it.

    `model` (the run's `--model`) is needed only where the checkpoint cannot rebuild what it does
    not hold: a factory model, frozen parameters of a model that started from weights. Both it
    and `tokenizer` default to what the node noted in its state dir (workload/remembered.py)."""
    path = _pick_checkpoint(state_dir, step)
    meta = read_metadata(path)
    remembered = remembered_workload(state_dir)
    if tokenizer is None and isinstance(remembered.get("tokenizer"), str) and Path(remembered["tokenizer"]).exists():
        tokenizer = Path(remembered["tokenizer"])
        log.info("the run's tokenizer: %s", tokenizer)
    try:
        description = json.loads(meta["model_config"])
        model_hash, run_id = meta["model_hash"], meta["run_id"]
    except (KeyError, ValueError):
        raise CheckpointError(f"{path.name} lacks its model description (written by an older dtnode?)") from None
    seed = int(meta.get("init_seed") or stable_seed(run_id, 0, "init"))
    if model is None and isinstance(remembered.get("model"), str) and _needs_model(description):
        model = remembered["model"]
    module = _rebuild(description, seed, model)
    flat = FlatParameters(module.named_parameters(), learned_buffers(module))
    loaded = read_checkpoint(path, Layout(tuple(flat.names), tuple(flat.shapes)), run_id, model_hash)
    flat.buffer.copy_(loaded.theta_g)
    out.mkdir(parents=True, exist_ok=True)
    transformers = require_transformers()
    hf_tokenizer = _export_tokenizer(tokenizer, description.get("tokenizer"), transformers)
    special = special_tokens(hf_tokenizer) if hf_tokenizer is not None else {}
    if isinstance(module, GPT):
        _save_model(gpt2_model(module, transformers), special, out)
    elif isinstance(module, CausalLM):
        _save_model(cast(Any, module.hf), special, out)
    else:  # a module:factory model: its state dict, loadable with the factory's load_state_dict
        save_model(module, str(out / "model.safetensors"))
    if hf_tokenizer is not None:
        hf_tokenizer.save_pretrained(out)
    (out / EXPORT_INFO).write_text(
        json.dumps(
            {
                "run_id": run_id,
                "outer_step": loaded.step,
                "checkpoint": path.name,
                "checkpoint_sha256": file_sha256(path),
                "model_hash": model_hash,
                "format": export_format(description),
            },
            indent=2,
        )
        + "\n"
    )
    log.info("exported outer step %d of run %s to %s", loaded.step, run_id, out)
    return out


def _pick_checkpoint(state_dir: Path, step: int | None) -> Path:
    found = list_checkpoints(state_dir)
    if not found:
        raise SettingsError("--state-dir", f"{state_dir} holds no checkpoint")
    if step is None:
        return found[0][1]
    for candidate, path in found:
        if candidate == step:
            return path
    raise SettingsError(
        "--step", f"no checkpoint of outer step {step} in {state_dir} (it holds {', '.join(str(s) for s, _ in found)})"
    )


def _needs_model(description: dict) -> bool:
    """Whether the checkpoint alone cannot rebuild the model (see _rebuild)."""
    return "factory" in description or bool(description.get("weights") and description.get("frozen"))


def _rebuild(description: dict, seed: int, model_spec: str | None) -> torch.nn.Module:
    if model_spec is not None:
        module, built = build_model(model_spec, seed)
        ours = {k: v for k, v in description.items() if k != "tokenizer"}
        if config_hash(built) != config_hash(ours):
            raise SettingsError("--model", f"{model_spec} is not the model of this checkpoint")
        return module
    if "factory" in description:
        raise SettingsError(
            "--model",
            f"give the run's --model {description['factory']} to export its weights "
            "(a factory model is rebuilt by calling it)",
        )
    if description.get("weights") and description.get("frozen"):
        raise SettingsError(
            "--model",
            "this model started from weights and has frozen parameters, which the "
            "checkpoint does not hold: give the run's --model hf:DIR",
        )
    try:
        return model_from_description(description, seed)
    except ValueError as e:
        raise SettingsError("--state-dir", str(e)) from None


def gpt2_model(model: GPT, transformers: Any) -> Any:
    """The preset as a transformers GPT-2 model with the same weights (Conv1D layers hold
    their weights transposed relative to nn.Linear)."""
    cfg = model.config
    config = transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.context_length,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=4 * cfg.d_model,
        activation_function="gelu",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    ours = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {
        "transformer.wte.weight": ours["tok.weight"],
        "transformer.wpe.weight": ours["pos.weight"],
        "transformer.ln_f.weight": ours["ln_f.weight"],
        "transformer.ln_f.bias": ours["ln_f.bias"],
    }
    linear = {"qkv": "attn.c_attn", "proj": "attn.c_proj", "mlp.0": "mlp.c_fc", "mlp.2": "mlp.c_proj"}
    norms = {"ln1": "ln_1", "ln2": "ln_2"}
    for i in range(cfg.n_layers):
        for src, dst in linear.items():
            state[f"transformer.h.{i}.{dst}.weight"] = ours[f"blocks.{i}.{src}.weight"].t()
            state[f"transformer.h.{i}.{dst}.bias"] = ours[f"blocks.{i}.{src}.bias"]
        for src, dst in norms.items():
            for kind in ("weight", "bias"):
                state[f"transformer.h.{i}.{dst}.{kind}"] = ours[f"blocks.{i}.{src}.{kind}"]
    hf = transformers.GPT2LMHeadModel(config)
    missing, unexpected = hf.load_state_dict({k: v.detach().contiguous() for k, v in state.items()}, strict=False)
    unexplained = [k for k in missing if k != "lm_head.weight" and not k.endswith(".attn.bias")]
    if unexplained or unexpected:
        raise RuntimeError(f"GPT-2 mapping incomplete: missing {unexplained[:3]}, unexpected {unexpected[:3]}")
    hf.tie_weights()
    return hf.eval()


def byte_level_tokenizer(transformers):
    """A fast tokenizer whose ids are UTF-8 bytes (GPT-2's byte-to-character map, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values onto printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


_SPECIAL_NAMES = {
    "eos": EOS_NAMES,  # in the order training looks for the end of a document
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]", "<|startoftext|>"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
}


def special_tokens(hf_tokenizer: Any) -> dict[str, tuple[str, int]]:
    """eos, bos and pad of the exported tokenizer as (token, id): eos is the token training
    ended every document with (workload/tokenizer.py's names); bos and pad are their own tokens when the
    vocabulary has them, else eos (as GPT-2 does). Empty when the vocabulary has no end token
    (the byte-level presets: their documents end with a newline byte)."""
    vocab = hf_tokenizer.get_vocab()
    found = {kind: next((n for n in names if n in vocab), None) for kind, names in _SPECIAL_NAMES.items()}
    eos = found["eos"]
    if eos is None:
        return {}
    return {
        kind: (token, int(vocab[token]))
        for kind, token in (("eos", eos), ("bos", found["bos"] or eos), ("pad", found["pad"] or eos))
    }


def _save_model(hf: Any, special: dict[str, tuple[str, int]], out: Path) -> None:
    """save_pretrained, with the tokenizer's eos, bos and pad ids in the config and the generation
    config: a config's own defaults (Llama's bos 1 and eos 2) name ordinary tokens of another
    vocabulary, and generate() would stop at them."""
    for kind in ("eos", "bos", "pad"):
        value = special[kind][1] if kind in special else None
        setattr(hf.config, f"{kind}_token_id", value)
        if getattr(hf, "generation_config", None) is not None:
            setattr(hf.generation_config, f"{kind}_token_id", value)
    hf.save_pretrained(out, safe_serialization=True)


def _export_tokenizer(path: Path | None, trained_with: str | None, transformers: Any) -> Any:
    """The run's tokenizer as a transformers tokenizer, its eos, bos and pad set (None: a run with
    a --tokenizer that export was not given)."""
    if path is None:
        if trained_with:
            log.warning(
                "this run trained with a --tokenizer; give it to export to include it (exported the model without one)"
            )
            return None
        return byte_level_tokenizer(transformers)
    tokenizer = LocalTokenizer(path)
    if trained_with and tokenizer.sha256 != trained_with:
        raise SettingsError("--tokenizer", f"{path} is not the tokenizer this run trained with")
    if path.is_dir() and (path / "tokenizer_config.json").is_file():
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    else:
        hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer.file))
    for kind, (token, _) in special_tokens(hf_tokenizer).items():
        setattr(hf_tokenizer, f"{kind}_token", token)
    return hf_tokenizer
