"""The options of what this node trains and how: the workload, the held-out loss, this host's
hardware, the inner optimizer and the DiLoCo rounds.

Each class is one group of NodeSettings (config/settings.py) and one section of `dtnode join
--help`; the field names are the flags' and the DTNODE_* variables' (--inner-steps, DTNODE_INNER_STEPS).
"""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from dtnode.daemon.config.option_group import OptionGroup

_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_GPUS = re.compile(r"^(all|\d+(,\d+)*,?)$")
# The words an option takes: pydantic names them in its error ("Input should be 'cosine', ..."),
# where a pattern would show users a regex
DataDtype = Literal["auto", "uint16", "uint32"]
Pacing = Literal["swarm", "fixed"]
LrSchedule = Literal["cosine", "linear", "constant"]
PrecisionName = Literal["auto", "bf16", "fp16", "fp32"]


def readable(value: Path | None) -> Path | None:
    """A path option that must name something this process can read (checked at start, not
    after the model is built)."""
    if value is not None and not (value.exists() and os.access(value, os.R_OK)):
        raise ValueError(f"cannot read {value}")
    return value


class WorkloadOptions(OptionGroup):
    """The model, the tokenizer and the training data: with the recipe below, what makes two peers' steps comparable."""

    TITLE: ClassVar[str] = "model and data"
    HELP: ClassVar[str] = "What this node trains, and on what."
    ADVANCED: ClassVar[frozenset[str]] = frozenset({"seed"})

    model: str = Field(
        "tiny",
        description="Model preset (tiny, small, base); 'hf:DIR', a transformers causal LM from a local "
        "directory with a config.json (and safetensors weights to start from them); 'hf:ORG/NAME', the "
        "same from the Hugging Face Hub through its cache (HF_HOME; HF_HUB_OFFLINE=1 reads only the "
        "cache); or 'module:factory' returning a torch.nn.Module.",
    )
    data: Path | None = Field(
        None,
        description="Training data: a UTF-8 text file or a directory of them, a "
        ".jsonl or .parquet file (or a directory of them) read through "
        "`datasets`, or a .bin file of token ids (nanoGPT/llm.c "
        "style); default: the built-in synthetic language seeded by "
        "the run id.",
    )
    tokenizer: Path | None = Field(
        None,
        description="Local tokenizer (a tokenizer.json, or a directory saved by "
        "transformers/tokenizers) for text data; default: byte-level "
        "tokens.",
    )
    text_field: str = Field(
        "text", min_length=1, max_length=256, description="The field holding the text in .jsonl and .parquet data."
    )
    data_dtype: DataDtype = Field(
        "auto",
        description="Token id type of .bin data: uint16, uint32, or auto (the llm.c header's, else uint16).",
    )
    seq_len: int | None = Field(None, ge=2, le=65536, description="Tokens per sequence (default: the model's context).")
    seed: int = Field(
        0, ge=0, description="Seed of the initial weights and the synthetic language (combined with the run id)."
    )

    @field_validator("model")
    @classmethod
    def _model_spec(cls, value: str) -> str:
        from dtnode.daemon.config.presets import HF_PREFIX, PRESETS

        if value.startswith(HF_PREFIX):
            source = value[len(HF_PREFIX) :]
            directory = Path(source).expanduser()
            if directory.exists() and not (directory / "config.json").is_file():
                raise ValueError(f"{directory} is not a directory with a config.json (hf:DIR)")
            if not directory.exists():
                from dtnode.daemon.config.model_source import is_hub_id

                if not is_hub_id(source):
                    raise ValueError(
                        f"{source} is not a directory with a config.json (hf:DIR), nor a Hugging Face Hub id "
                        "(hf:ORG/NAME)"
                    )
            return value
        if value not in PRESETS and not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", value):
            raise ValueError(f"unknown model {value!r}; use one of {', '.join(PRESETS)}, hf:DIR or module:factory")
        return value

    @field_validator("data", "tokenizer")
    @classmethod
    def _readable_data(cls, value: Path | None) -> Path | None:
        return readable(value)


class HardwareOptions(OptionGroup):
    """The devices, ranks and arithmetic of this host: what a peer chooses for itself, never taken from the swarm."""

    TITLE: ClassVar[str] = "this host's training"
    HELP: ClassVar[str] = "How this host computes its inner steps; peers may differ here."
    ADVANCED: ClassVar[frozenset[str]] = frozenset()

    device: str = Field(
        "auto",
        description="Torch device: auto, cpu, cuda, cuda:N or mps. With cuda (or auto on a "
        "GPU host) the node starts one training rank per GPU that --gpus selects; cuda:N "
        "trains on that one GPU.",
    )
    gpus: str = Field(
        "all",
        description="The GPUs this node trains on, one local rank each: all, or their indices "
        "(0; 0,3,5), as CUDA_VISIBLE_DEVICES numbers them. The host stays one peer of the swarm "
        "whatever the count; --nproc-per-node N takes the first N of them.",
    )
    precision: PrecisionName = Field(
        "auto",
        description="Arithmetic of the inner steps' forward and backward passes: bf16 or fp16 "
        "(autocast; fp16 with a dynamic loss scale, for GPUs without bf16 such as V100 and T4) "
        "or fp32. auto: bf16 on a GPU that has it, else fp16 on a GPU, fp32 on a CPU. The "
        "weights, θ_g and what peers exchange stay fp32 whatever this says.",
    )
    nproc_per_node: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Local training ranks: on a CPU, N data-parallel ranks over gloo (how "
        "tests exercise a multi-GPU host); on GPUs, the first N of --gpus. Default: one per "
        "selected GPU, or 1 on a CPU.",
    )
    shard: bool = Field(
        False,
        description="Split the model's weights, gradients and AdamW state over the local ranks "
        "(FSDP2 fully_shard) instead of a full replica per rank: for models that do not fit "
        "one device. Rank 0 keeps the node's θ_l, θ_g and outer state in host memory.",
    )
    threads_per_rank: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="CPU threads of each local rank's torch (default: torch's own with one "
        "rank; the host's cores divided by the ranks with several; under `dtnode local`, "
        "divided by its nodes' ranks).",
    )
    compile: bool = Field(
        False,
        description="Compile the model with torch.compile (faster inner steps on a "
        "GPU after a compile of a minute or so).",
    )
    batch_size: int = Field(
        16,
        ge=1,
        le=65536,
        description="Sequences per inner step and local rank (a node with N ranks takes N times as many per step).",
    )

    @field_validator("gpus")
    @classmethod
    def _gpu_indices(cls, value: str) -> str:
        value = value.strip().lower()
        if not _GPUS.match(value):
            raise ValueError(f"{value!r}: write all, or GPU indices such as 0 or 0,3,5")
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"unknown device {value!r}; use auto, cpu, cuda, cuda:N or mps")
        return value

    @model_validator(mode="after")
    def _one_device_one_rank(self) -> HardwareOptions:
        if (self.device == "mps" or self.device.startswith("cuda:")) and (self.nproc_per_node or 1) > 1:
            raise ValueError(f"nproc_per_node: --device {self.device} is one device; use --gpus to train on several")
        return self


class DilocoOptions(OptionGroup):
    """The length and pacing of a round, the outer Nesterov SGD, and when the run ends."""

    TITLE: ClassVar[str] = "DiLoCo rounds"
    HELP: ClassVar[str] = (
        "The rounds and the outer optimizer: what every peer of a swarm shares (a joiner takes them from the swarm)."
    )
    ADVANCED: ClassVar[frozenset[str]] = frozenset({"max_own_rounds"})

    inner_steps: int = Field(
        20,
        ge=1,
        le=1_000_000,
        description="H: the size of a round in inner steps of an "
        "average peer (with --pacing fixed: exactly H "
        "steps on every peer).",
    )
    pacing: Pacing = Field(
        "swarm",
        description="swarm: a round ends when the swarm "
        "has processed its tokens (every peer "
        "trains until then, weighted by its "
        "tokens); fixed: every peer takes "
        "exactly H steps.",
    )
    round_tokens: int | None = Field(
        None,
        ge=1,
        description="With --pacing swarm: tokens the whole swarm "
        "processes per round (default: H steps of every "
        "live peer).",
    )
    round_seconds: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="Time budget of a round's inner steps, in seconds: the round ends then even if "
        "its tokens are not reached. With --pacing swarm it counts from the swarm's median start "
        "of the round, so that peers end their steps together (at most half a budget sooner or "
        "later than counted from this node's own start); with --pacing fixed, from this node's start.",
    )
    overlap: bool = Field(
        False,
        description="Train the next round while this round's Δ is averaged, and apply "
        "the averaged update between two inner steps as soon as it is in: "
        "the network's time hides behind compute; set it on every peer.",
    )
    outer_lr: float = Field(
        0.7, gt=0, le=10, description="Learning rate of the outer Nesterov SGD (--compression sparse: 1.0)."
    )
    outer_momentum: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="Momentum of the outer Nesterov SGD (--compression sparse: 0, its error feedback takes "
        "momentum's place).",
    )
    max_rounds: int | None = Field(
        None,
        ge=1,
        description="Exit 0 once the swarm's outer step reaches N: every node of the swarm stops at the same "
        "step, however late it joined; a node whose swarm stopped first stops too, never training alone. "
        "A node joining by a sidecar address takes it from that peer, and the printed join line carries it "
        "(default: run forever).",
    )
    max_own_rounds: int | None = Field(
        None,
        ge=1,
        description="Exit 0 after this process has taken part in N outer rounds, wherever the swarm is (a "
        "benchmark's or a test's joiner; a swarm's run ends with --max-rounds).",
    )


class InnerOptimizerKind(str, Enum):
    """Which inner optimizer a swarm trains with (a recipe field: one swarm, one kind;
    training/inner_optimizer.py builds it)."""

    ADAMW = "adamw"
    MUON = "muon"


class InnerOptimizerOptions(OptionGroup):
    """The inner optimizer, its rate, decay and schedule: part of the recipe a joiner takes from its swarm."""

    TITLE: ClassVar[str] = "inner optimizer"
    HELP: ClassVar[str] = "The inner optimizer and its learning-rate schedule, shared by the swarm."
    ADVANCED: ClassVar[frozenset[str]] = frozenset({"inner_weight_decay", "grad_clip"})

    inner_optimizer: InnerOptimizerKind = Field(
        InnerOptimizerKind.MUON,
        description="The inner optimizer: muon (Muon on the hidden weight matrices, AdamW on embeddings, "
        "the output layer, gains and biases, at the same --inner-lr: Muon's rate is matched to AdamW's "
        "RMS; it trained better than AdamW at every rate and H measured), or adamw (AdamW on every "
        "parameter, DiLoCo's own; the default until 2026-12: give it to join a swarm started with it).",
    )
    inner_lr: float = Field(1e-3, gt=0, le=1, description="Peak learning rate of the inner optimizer.")
    lr_schedule: LrSchedule = Field(
        "cosine",
        description="Decay of the inner learning rate after warmup, over --total-steps: cosine, linear or constant.",
    )
    warmup_steps: int = Field(
        50,
        ge=0,
        description="Linear warmup of the inner learning rate, in inner steps "
        "(again for a joiner whose inner optimizer starts fresh).",
    )
    total_steps: int | None = Field(
        None,
        ge=1,
        description="Length of the learning-rate schedule in the swarm's "
        "inner steps (outer steps x H); the rate then stays "
        "at its floor. Default: no decay (a swarm that runs "
        "for ever has no end to decay toward).",
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="The inner learning rate at the end of the schedule, as a fraction of --inner-lr."
    )
    inner_weight_decay: float = Field(
        0.1, ge=0, le=1, description="Weight decay of the inner optimizer (not on gains and biases)."
    )
    grad_clip: float = Field(1.0, ge=0, description="Gradient norm clip of inner steps (0 disables).")

    @model_validator(mode="after")
    def _decay_after_warmup(self) -> InnerOptimizerOptions:
        if self.total_steps is not None and self.total_steps <= self.warmup_steps and self.lr_schedule != "constant":
            raise ValueError("total_steps: must exceed --warmup-steps (the decay follows the warmup)")
        return self


class EvaluationOptions(OptionGroup):
    """The held-out set and how often θ_g is evaluated on it."""

    TITLE: ClassVar[str] = "evaluation"
    HELP: ClassVar[str] = "How the held-out loss is measured."
    ADVANCED: ClassVar[frozenset[str]] = frozenset()

    eval_data: Path | None = Field(
        None,
        description="Held-out data for the eval loss, in any --data format (default: --eval-fraction of "
        "--data's documents, chosen by a hash of their names, whole, which training then never reads).",
    )
    eval_fraction: float = Field(
        0.01,
        ge=0,
        lt=1,
        description="With --data and no --eval-data: the fraction of the documents held out for the eval "
        "loss, chosen by a hash of their names (of a single text or .bin file: of its tokens, at its end); at "
        "least one sequence's worth, at most a fifth of the data, else no eval loss (0: none).",
    )
    eval_sequences: int = Field(
        64, ge=0, le=1_000_000, description="Sequences in the eval set, the same on every peer (0: no eval loss)."
    )
    eval_every: int = Field(
        1,
        ge=0,
        le=1_000_000,
        description="Evaluate θ_g on the eval set every N outer "
        "steps (0: never). Each eval is a "
        "forward pass over --eval-sequences windows, "
        "time the round does not train: with short "
        "rounds, evaluate less often.",
    )

    @field_validator("eval_data")
    @classmethod
    def _readable_data(cls, value: Path | None) -> Path | None:
        return readable(value)
