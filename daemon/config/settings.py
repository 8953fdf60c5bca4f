"""The node's settings: one pydantic model for every option.

Precedence, lowest to highest: defaults < TOML file (`--config` / DTNODE_CONFIG) <
environment variables `DTNODE_<NAME>` < CLI flags. The CLI is generated from this model, so
every option has exactly one name, one type and one help text.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings import SettingsError as PydanticSettingsError

if TYPE_CHECKING:  # torch comes with them: `dtnode --help` and a bad flag answer without it
    from dtnode.peers.plan import WireFormat

ENV_PREFIX = "DTNODE_"
# --compression sparse changes these defaults (an explicit value, from any source, wins):
# SparseLoCo's outer step (error feedback replaces momentum), and no periodic fp32 re-sync
SPARSE_DEFAULTS: dict[str, float | int] = {"outer_lr": 1.0, "outer_momentum": 0.0, "consensus_every": 0}
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_RUN_ID = re.compile(r"^[A-Za-z0-9._-]+$")
_GPUS = re.compile(r"^(all|\d+(,\d+)*,?)$")
# The words an option takes: pydantic names them in its error ("Input should be 'int8', 'sparse'
# or 'fp32'"), where a pattern would show users a regex
DataDtype = Literal["auto", "uint16", "uint32"]
Pacing = Literal["swarm", "fixed"]
LrSchedule = Literal["cosine", "linear", "constant"]
Aggregation = Literal["mean", "trimmed-mean", "median"]
CompressionName = Literal["int8", "sparse", "fp32"]
PrecisionName = Literal["auto", "bf16", "fp16", "fp32"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LogFormat = Literal["human", "json"]
# DTNODE_* variables that are not options: test hooks (DTNODE_TEST_*), a rank's spec from its
# host, and what CI hands the browser test. Any other DTNODE_* name is a misspelt option.
NOT_OPTIONS = ("DTNODE_TEST_", "DTNODE_LOCAL_RANK_SPEC", "DTNODE_REQUIRE_BROWSER", "DTNODE_SCREENSHOT_DIR")


class SettingsError(ValueError):
    """A bad option value; `option` names it the way the user wrote it (flag form)."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class NodeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # Swarm identity and membership
    run_id: str = Field(
        "dtnode-demo",
        min_length=1,
        max_length=64,
        description="Name of the training run; only peers with the same run id train together.",
    )
    peers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="A swarm member to join through (repeatable; comma-separated in DTNODE_PEERS): its "
        "sidecar address (http://node1:7702), whose /status names its multiaddrs, or a multiaddr "
        "(/ip4/1.2.3.4/tcp/7700/p2p/Qm...). Without it, and with no peer known from an earlier run "
        "in --state-dir, give --new-swarm.",
    )
    new_swarm: bool = Field(
        False,
        description="Start a new swarm when no --peer is given and --state-dir knows no peer of an "
        "earlier run (without it such a node stops with an error instead of training alone).",
    )
    config: Path | None = Field(
        None, description="TOML file with option values (keys as in this list, with underscores)."
    )
    state_dir: Path = Field(Path("state"), description="Directory for checkpoints and node identity.")
    # Network
    host: str = Field("0.0.0.0", description="Interface to listen on for DHT, gRPC and HTTP.")
    announce_host: str | None = Field(
        None,
        description="Address other peers should use to reach this node "
        "(default: detected from the listening interfaces).",
    )
    dht_port: int = Field(7700, ge=0, le=65535, description="TCP port of the DHT (libp2p); 0 picks a free port.")
    grpc_port: int = Field(
        7701, ge=0, le=65535, description="TCP port of the averaging gRPC server; 0 picks a free one."
    )
    http_port: int = Field(7702, ge=0, le=65535, description="TCP port of the HTTP sidecar; 0 picks a free one.")
    status_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve the dashboard, /status, /history, /metrics and /peers on --status-host at this port "
        "instead of --http-port, which then serves what peers need only (checkpoints, /healthz, /dialback); "
        "0 picks a free one. A peer then joins through this node's multiaddr, not its sidecar address.",
    )
    status_host: str = Field(
        "127.0.0.1",
        min_length=1,
        max_length=255,
        description="With --status-port: the address the dashboard and status listen on (this host only by default).",
    )
    client_mode: bool = Field(False, description="Behind NAT: open only outbound streams and reduce no part.")
    swarm_key_file: Path | None = Field(
        None,
        description="File holding the swarm's secret key (at least 16 "
        "bytes, e.g. `openssl rand -hex 32`): only holders "
        "may average with this node or download its state.",
    )
    swarm_key: SecretStr | None = Field(
        None,
        description="The swarm key itself; set it through the environment (DTNODE_SWARM_KEY), never on a command line.",
    )
    require_swarm_key: bool = Field(
        False,
        description="Refuse to start without a swarm key. The deploy files set it: a key secret "
        "missing from a cluster then fails the start instead of silently running an open "
        "swarm. Set it false there for an open swarm on purpose.",
    )
    insecure_data_plane: bool = Field(
        False,
        description="Average over plaintext gRPC instead of mutual TLS "
        "pinned to each peer's signed record; only on a "
        "trusted LAN, and on every peer of the swarm alike.",
    )
    join_timeout: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds to reach the DHT and the initial peers before giving up with an error "
        "(--peer is dialled again every 2 s until then: it may still be starting).",
    )
    min_peers: int = Field(
        1,
        ge=1,
        le=10_000,
        description="Wait (up to --join-timeout) until this many members are visible before the first round.",
    )
    heartbeat_interval: float = Field(2.0, gt=0, le=60, description="Seconds between membership heartbeats.")
    peer_ttl: float = Field(6.0, gt=0, le=600, description="Seconds a membership record lives without a heartbeat.")
    # Model and data
    model: str = Field(
        "tiny",
        description="Model preset (tiny, small, base); 'hf:DIR', a transformers causal LM from a local "
        "directory with a config.json (and safetensors weights to start from them); 'hf:ORG/NAME', the "
        "same from the Hugging Face Hub through its cache (HF_HOME; HF_HUB_OFFLINE=1 reads only the "
        "cache); or 'module:factory' returning a torch.nn.Module.",
    )
    tokenizer: Path | None = Field(
        None,
        description="Local tokenizer (a tokenizer.json, or a directory saved by "
        "transformers/tokenizers) for text data; default: byte-level "
        "tokens.",
    )
    data: Path | None = Field(
        None,
        description="Training data: a UTF-8 text file or a directory of them, a "
        ".jsonl or .parquet file (or a directory of them) read through "
        "`datasets`, or a .bin file of token ids (nanoGPT/llm.c "
        "style); default: the built-in synthetic language seeded by "
        "the run id.",
    )
    text_field: str = Field(
        "text", min_length=1, max_length=256, description="The field holding the text in .jsonl and .parquet data."
    )
    data_dtype: DataDtype = Field(
        "auto",
        description="Token id type of .bin data: uint16, uint32, or auto (the llm.c header's, else uint16).",
    )
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
    seed: int = Field(
        0, ge=0, description="Seed of the initial weights and the synthetic language (combined with the run id)."
    )
    batch_size: int = Field(
        16,
        ge=1,
        le=65536,
        description="Sequences per inner step and local rank (a node with N ranks takes N times as many per step).",
    )
    seq_len: int | None = Field(None, ge=2, le=65536, description="Tokens per sequence (default: the model's context).")
    # DiLoCo
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
        description="Time budget of a round's inner "
        "steps, in seconds: the round ends "
        "then even if its tokens are not "
        "reached.",
    )
    inner_lr: float = Field(1e-3, gt=0, le=1, description="Peak learning rate of the inner AdamW.")
    inner_weight_decay: float = Field(0.1, ge=0, le=1, description="Weight decay of the inner AdamW.")
    warmup_steps: int = Field(
        50,
        ge=0,
        description="Linear warmup of the inner learning rate, in inner steps "
        "(again for a joiner whose inner optimizer starts fresh).",
    )
    lr_schedule: LrSchedule = Field(
        "cosine",
        description="Decay of the inner learning rate after warmup, over --total-steps: cosine, linear or constant.",
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
    grad_clip: float = Field(1.0, ge=0, description="Gradient norm clip of inner steps (0 disables).")
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
    overlap: bool = Field(
        False,
        description="Train the next round while this round's Δ is averaged, and apply "
        "the averaged update between two inner steps as soon as it is in: "
        "the network's time hides behind compute; set it on every peer.",
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
    # Averaging
    target_group_size: int = Field(
        16, ge=1, le=1024, description="Peers per averaging group; larger rounds split deterministically."
    )
    grid_dims: int = Field(
        0,
        ge=0,
        le=8,
        description="d: averaging hops per outer step (moshpit grid "
        "dimensions); 0 derives it from the swarm size and "
        "--target-group-size.",
    )
    matchmaking_window: float = Field(
        15.0,
        gt=0,
        le=600,
        description="Upper bound, in seconds, of the window a "
        "hop waits for missing group members; the "
        "window adapts to measured arrival times.",
    )
    matchmaking_window_min: float = Field(
        1.0, gt=0, le=600, description="Lower bound of the adaptive matchmaking window, in seconds."
    )
    allreduce_timeout: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Upper bound, in seconds, of the all-reduce "
        "deadline; the deadline adapts to measured "
        "transfer rates.",
    )
    allreduce_timeout_min: float = Field(
        3.0, gt=0, le=3600, description="Lower bound of the adaptive all-reduce deadline, in seconds."
    )
    consensus_every: int = Field(
        25,
        ge=0,
        le=1_000_000,
        description="Every this many outer steps, also average "
        "θ_g and the outer momentum (fp32) over the "
        "step's groups, so "
        "int8 differences between groups cannot "
        "accumulate (a group whose members hold the same θ_g skips it); 0 disables (the default "
        "with --compression sparse, where an fp32 re-sync would cost 300 rounds of its traffic).",
    )
    aggregation: Aggregation = Field(
        "mean",
        description="How this node reduces its part: mean (token-weighted), trimmed-mean (robust to "
        "--trim-fraction of hostile members per group, at least one from 3 up) or median (the "
        "coordinate-wise median: robust to a minority of hostile members, noisier).",
    )
    trim_fraction: float = Field(
        0.2,
        ge=0,
        lt=0.5,
        description="With --aggregation trimmed-mean: fraction of values dropped at each end, per coordinate.",
    )
    error_feedback: bool = Field(
        False,
        description="Carry the int8 quantization residual of this node's pseudo-gradient into the next round "
        "(--compression sparse always carries what it did not send).",
    )
    in_flight_chunks: int = Field(
        4, ge=1, le=64, description="Encoded chunks a stream may hold ahead of the network (bounds sender memory)."
    )
    fused_kernels: bool = Field(
        True,
        description="Compile the CPU int8 kernels with torch.compile in the "
        "background (eager kernels until ready, and if compiling "
        "fails).",
    )
    quant_block_size: int = Field(256, ge=8, le=1 << 20, description="Values per int8 quantization block.")
    chunk_elements: int = Field(
        1 << 20, ge=1024, le=1 << 26, description="Values per streamed chunk (a multiple of the block size)."
    )
    compression: CompressionName = Field(
        "int8",
        description="Wire format of pseudo-gradients: int8 (blockwise, 1 byte per parameter), sparse (top-k "
        "per block with 2-bit values and error feedback, about 0.022 bytes per parameter) or fp32. "
        "'none' is read as fp32.",
    )
    sparse_block_size: int = Field(
        4096, ge=16, le=4096, description="With --compression sparse: values per top-k block (at most 4096)."
    )
    sparse_top_k: int = Field(
        64,
        ge=1,
        le=4096,
        description="With --compression sparse: values kept (sent) per block; the rest wait in "
        "the error-feedback buffer.",
    )
    feedback_decay: float = Field(
        0.95,
        gt=0,
        le=1,
        description="With --compression sparse: the error-feedback buffer is multiplied by this each round "
        "before it joins the next Δ (1 keeps all of it; SparseLoCo's 0.95 measured better here).",
    )
    bandwidth_mbps: float = Field(
        1000.0, gt=0, description="This node's bandwidth in Mbit/s, used to size the part it reduces."
    )
    max_lag: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Outer steps a node may trail the swarm's open "
        "round and still train its own round (alone) "
        "instead of downloading the swarm's state when "
        "the round starts; 0: download whenever behind. "
        "A node that joins or restarts always downloads.",
    )
    health_stall_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="/healthz answers 503 when the training thread has taken no inner step for this many "
        "seconds while the node is in its inner steps (a hung GPU, a deadlock): what a liveness probe restarts on.",
    )
    # Checkpoints
    checkpoint_every: int = Field(
        10,
        ge=1,
        le=1_000_000,
        description="Write a checkpoint every this many outer "
        "steps (and on stop; a peer that needs the "
        "current step gets one written on demand).",
    )
    keep_checkpoints: int = Field(3, ge=1, le=1000, description="Newest checkpoints kept in the state dir.")
    # Logging
    log_level: LogLevel = Field("INFO", description="Log level: DEBUG, INFO, WARNING or ERROR.")
    log_format: LogFormat = Field(
        "human",
        description="human: one readable line per event; json: one JSON object per line "
        "(time, level, logger, message, and the traceback if any) for log "
        "collectors.",
    )

    @property
    def averaging_bound_s(self) -> float:
        """The longest a healthy round waits on its averaging: the matchmaking window plus the
        all-reduce timeout (ARCHITECTURE.md's first failure promise)."""
        return self.matchmaking_window + self.allreduce_timeout

    @field_validator("peers", mode="before")
    @classmethod
    def _peer_list(cls, value: object) -> object:
        """DTNODE_PEERS and a TOML string may list peers comma-separated (or as a JSON list)."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except json.JSONDecodeError:
                    raise ValueError(f"{text!r} is neither a JSON list nor comma-separated addresses") from None
            value = [text]
        if isinstance(value, list | tuple):
            return [
                part.strip()
                for item in value
                for part in (item.split(",") if isinstance(item, str) else [item])
                if not isinstance(part, str) or part.strip()
            ]
        return value

    @field_validator("peers")
    @classmethod
    def _peer_addresses(cls, peers: list[str]) -> list[str]:
        from dtnode.peers.peer_address import parse_peer_address

        for peer in peers:
            if peer.startswith(("http://", "https://")):
                continue
            if not peer.startswith("/"):
                raise ValueError(
                    f"{peer!r} is neither a sidecar address like http://node1:7702 nor a multiaddr like "
                    "/ip4/203.0.113.7/tcp/7700/p2p/Qm..."
                )
            parse_peer_address(peer)  # its error says what is wrong and shows a valid one
        return peers

    @field_validator("run_id")
    @classmethod
    def _run_id_characters(cls, value: str) -> str:
        if not _RUN_ID.match(value):
            raise ValueError(f"{value!r} may hold letters, digits, '.', '_' and '-' only")
        return value

    @field_validator("gpus")
    @classmethod
    def _gpu_indices(cls, value: str) -> str:
        value = value.strip().lower()
        if not _GPUS.match(value):
            raise ValueError(f"{value!r}: write all, or GPU indices such as 0 or 0,3,5")
        return value

    @field_validator("compression", mode="before")
    @classmethod
    def _compression_alias(cls, value: object) -> object:
        return "fp32" if value == "none" else value  # the name before sparse existed

    def robust_trim(self) -> float | None:
        """The fraction of values the reducer trims at each end per coordinate; None: the plain mean."""
        if self.aggregation == "median":
            from dtnode.ops.robust import MEDIAN_FRACTION

            return MEDIAN_FRACTION
        return self.trim_fraction if self.aggregation == "trimmed-mean" else None

    def wire_format(self) -> WireFormat:
        """How this node's Δ travels, for the averager and the status figures."""
        from dtnode.peers.plan import Compression, WireFormat

        compression = Compression(self.compression)
        if compression == Compression.SPARSE:
            return WireFormat(compression, self.sparse_block_size, self.sparse_top_k)
        return WireFormat(compression, self.quant_block_size)

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"unknown device {value!r}; use auto, cpu, cuda, cuda:N or mps")
        return value

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

    @field_validator("data", "eval_data", "tokenizer")
    @classmethod
    def _readable_data(cls, value: Path | None) -> Path | None:
        if value is not None and not (value.exists() and os.access(value, os.R_OK)):
            raise ValueError(f"cannot read {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> NodeSettings:
        if (self.device == "mps" or self.device.startswith("cuda:")) and (self.nproc_per_node or 1) > 1:
            raise ValueError(f"nproc_per_node: --device {self.device} is one device; use --gpus to train on several")
        if self.chunk_elements % self.quant_block_size:
            raise ValueError("chunk_elements: must be a multiple of --quant-block-size")
        if self.compression == "sparse" and self.chunk_elements % self.sparse_block_size:
            raise ValueError("chunk_elements: must be a multiple of --sparse-block-size")
        if self.compression == "sparse" and self.sparse_top_k > self.sparse_block_size:
            raise ValueError("sparse_top_k: must not exceed --sparse-block-size")
        if self.compression == "sparse":
            for name, value in SPARSE_DEFAULTS.items():  # what a user did not set follows the sparse recipe
                if name not in self.model_fields_set:
                    setattr(self, name, value)
        if self.compression == "sparse" and self.aggregation != "mean":
            raise ValueError(
                f"aggregation: {self.aggregation} does not combine with --compression sparse (a value only a few "
                "members kept would be trimmed away, and their error feedback would count it as sent)"
            )
        if self.matchmaking_window_min > self.matchmaking_window:
            raise ValueError("matchmaking_window_min: must not exceed --matchmaking-window")
        if self.allreduce_timeout_min > self.allreduce_timeout:
            raise ValueError("allreduce_timeout_min: must not exceed --allreduce-timeout")
        if self.eval_data is not None and self.data is None:
            raise ValueError("eval_data: needs --data (the synthetic language has its own eval set)")
        if self.total_steps is not None and self.total_steps <= self.warmup_steps and self.lr_schedule != "constant":
            raise ValueError("total_steps: must exceed --warmup-steps (the decay follows the warmup)")
        if self.peer_ttl <= self.heartbeat_interval:
            raise ValueError("peer_ttl: must be longer than --heartbeat-interval")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = init_settings().get("config") or os.environ.get(ENV_PREFIX + "CONFIG")
        return (init_settings, env_settings, *((ConfigFile(settings_cls, Path(path)),) if path else ()))


class ConfigFile(TomlConfigSettingsSource):
    """pydantic-settings' TOML source for the file `--config` (or DTNODE_CONFIG) names, with
    errors that name `--config`: a file that cannot be read, is not TOML, or has keys that are
    no option. Keys may be written with dashes, like the flags."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path):
        if not path.is_file() or not os.access(path, os.R_OK):
            reason = "no such file" if not path.exists() else "not a readable file"
            raise SettingsError("--config", f"cannot read {path}: {reason}")
        super().__init__(settings_cls, toml_file=path)

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        try:
            values = super()._read_file(file_path)
        except OSError as e:
            raise SettingsError("--config", f"cannot read {file_path}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise SettingsError("--config", f"{file_path} is not valid TOML: {e}") from None
        values = {k.replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - set(NodeSettings.model_fields))
        if unknown:
            raise SettingsError("--config", f"{file_path} has unknown option(s): {', '.join(unknown)}")
        values.pop("config", None)
        return values


def unknown_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """DTNODE_* variables that name no option (DTNODE_PEER for DTNODE_PEERS): each is an error,
    where pydantic-settings would ignore it and the node would start without what it says."""
    environ = os.environ if environ is None else environ
    options = {ENV_PREFIX + name.upper() for name in NodeSettings.model_fields}
    return sorted(
        name
        for name in environ
        if name.startswith(ENV_PREFIX) and name not in options and not name.startswith(NOT_OPTIONS)
    )


def _closest_option(variable: str) -> str:
    names = [ENV_PREFIX + name.upper() for name in NodeSettings.model_fields]
    close = difflib.get_close_matches(variable, names, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def load_settings(cli_values: dict[str, Any]) -> NodeSettings:
    """Build the settings; raise SettingsError naming the first bad option."""
    for variable in unknown_environment():
        raise SettingsError(variable, f"no option has this name{_closest_option(variable)}")
    try:
        return NodeSettings(**cli_values)
    except PydanticSettingsError as e:  # an environment value that does not parse
        found = re.search(r'field "(\w+)"', str(e))
        name = found.group(1) if found else ""
        variable = ENV_PREFIX + name.upper() if name else "a DTNODE_* variable"
        raise SettingsError(variable, f"cannot parse {os.environ.get(variable, '')!r}") from None
    except ValidationError as e:
        err = e.errors()[0]
        message = err["msg"].removeprefix("Value error, ")
        if err["loc"]:
            name = str(err["loc"][0])
        else:  # model-level checks start their message with the field they blame
            name, _, message = message.partition(": ")
        option = "--peer" if name == "peers" else flag(name)
        if name not in cli_values and ENV_PREFIX + name.upper() in os.environ:
            option = f"{option} (from {ENV_PREFIX}{name.upper()})"
        raise SettingsError(option, message) from None
