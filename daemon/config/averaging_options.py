"""The options of how this node averages and keeps its state: groups, the wire format,
checkpoints and its operation (health, logs).

Each class is one group of NodeSettings (config/settings.py) and one section of `dtnode join
--help`; the field names are the flags' and the DTNODE_* variables' (--target-group-size,
DTNODE_TARGET_GROUP_SIZE).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from dtnode.daemon.config.option_group import OptionGroup

if TYPE_CHECKING:  # torch comes with them: `dtnode --help` and a bad flag answer without it
    from dtnode.peers.plan import WireFormat

Aggregation = Literal["mean", "trimmed-mean", "median"]
CompressionName = Literal["int8", "sparse", "fp32"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LogFormat = Literal["human", "json"]


class AveragingOptions(OptionGroup):
    """Moshpit groups, the adaptive windows and deadlines, the periodic fp32 re-sync and the robust reduction."""

    TITLE: ClassVar[str] = "averaging"
    HELP: ClassVar[str] = "How groups form, how long a round waits on them, and how this node reduces its part."
    ADVANCED: ClassVar[frozenset[str]] = frozenset(
        {
            "grid_dims",
            "matchmaking_window",
            "matchmaking_window_min",
            "allreduce_timeout",
            "allreduce_timeout_min",
            "consensus_every",
        }
    )

    target_group_size: int = Field(
        16, ge=1, le=1024, description="Peers per averaging group; larger rounds split deterministically."
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

    @property
    def bound_s(self) -> float:
        """The longest a healthy round waits on its averaging: the matchmaking window plus the
        all-reduce timeout (ARCHITECTURE.md's first failure promise)."""
        return self.matchmaking_window + self.allreduce_timeout

    def robust_trim(self) -> float | None:
        """The fraction of values the reducer trims at each end per coordinate; None: the plain mean."""
        if self.aggregation == "median":
            from dtnode.ops.robust import MEDIAN_FRACTION

            return MEDIAN_FRACTION
        return self.trim_fraction if self.aggregation == "trimmed-mean" else None

    @model_validator(mode="after")
    def _bounds_in_order(self) -> AveragingOptions:
        if self.matchmaking_window_min > self.matchmaking_window:
            raise ValueError("matchmaking_window_min: must not exceed --matchmaking-window")
        if self.allreduce_timeout_min > self.allreduce_timeout:
            raise ValueError("allreduce_timeout_min: must not exceed --allreduce-timeout")
        return self


class WireOptions(OptionGroup):
    """The compression of Δ, its error feedback, and the streams' chunking (the format is part of the swarm's recipe)."""

    TITLE: ClassVar[str] = "wire format"
    HELP: ClassVar[str] = "How pseudo-gradients travel: compression, its blocks, and the streams."
    ADVANCED: ClassVar[frozenset[str]] = frozenset(
        {
            "quant_block_size",
            "chunk_elements",
            "in_flight_chunks",
            "fused_kernels",
            "sparse_block_size",
            "sparse_top_k",
            "feedback_decay",
        }
    )

    compression: CompressionName = Field(
        "int8",
        description="Wire format of pseudo-gradients: int8 (blockwise, 1 byte per parameter), sparse (top-k "
        "per block with 2-bit values and error feedback, about 0.022 bytes per parameter) or fp32. "
        "'none' is read as fp32.",
    )
    error_feedback: bool = Field(
        False,
        description="Carry the int8 quantization residual of this node's pseudo-gradient into the next round "
        "(--compression sparse always carries what it did not send).",
    )
    quant_block_size: int = Field(256, ge=8, le=1 << 20, description="Values per int8 quantization block.")
    chunk_elements: int = Field(
        1 << 20, ge=1024, le=1 << 26, description="Values per streamed chunk (a multiple of the block size)."
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

    @field_validator("compression", mode="before")
    @classmethod
    def _compression_alias(cls, value: object) -> object:
        return "fp32" if value == "none" else value  # the name before sparse existed

    def wire_format(self) -> WireFormat:
        """How this node's Δ travels, for the averager and the status figures."""
        from dtnode.peers.plan import Compression, WireFormat

        compression = Compression(self.compression)
        if compression == Compression.SPARSE:
            return WireFormat(compression, self.sparse_block_size, self.sparse_top_k)
        return WireFormat(compression, self.quant_block_size)

    @model_validator(mode="after")
    def _whole_blocks(self) -> WireOptions:
        if self.chunk_elements % self.quant_block_size:
            raise ValueError("chunk_elements: must be a multiple of --quant-block-size")
        if self.compression == "sparse" and self.chunk_elements % self.sparse_block_size:
            raise ValueError("chunk_elements: must be a multiple of --sparse-block-size")
        if self.compression == "sparse" and self.sparse_top_k > self.sparse_block_size:
            raise ValueError("sparse_top_k: must not exceed --sparse-block-size")
        return self


class CheckpointOptions(OptionGroup):
    """The state dir and the checkpoints in it, which restarts and late joiners start from."""

    TITLE: ClassVar[str] = "checkpoints"
    HELP: ClassVar[str] = "Where this node keeps its state, and how often it writes it."
    ADVANCED: ClassVar[frozenset[str]] = frozenset()

    state_dir: Path = Field(Path("state"), description="Directory for checkpoints and node identity.")
    checkpoint_every: int = Field(
        10,
        ge=1,
        le=1_000_000,
        description="Write a checkpoint every this many outer "
        "steps (and on stop; a peer that needs the "
        "current step gets one written on demand).",
    )
    keep_checkpoints: int = Field(3, ge=1, le=1000, description="Newest checkpoints kept in the state dir.")


class OperationsOptions(OptionGroup):
    """What a supervisor and a log collector see of this node."""

    TITLE: ClassVar[str] = "operations"
    HELP: ClassVar[str] = "Health, logs, and the file more options come from."
    ADVANCED: ClassVar[frozenset[str]] = frozenset()

    health_stall_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="/healthz answers 503 when the training thread has taken no inner step for this many "
        "seconds while the node is in its inner steps (a hung GPU, a deadlock): what a liveness probe restarts on.",
    )
    log_level: LogLevel = Field("INFO", description="Log level: DEBUG, INFO, WARNING or ERROR.")
    log_format: LogFormat = Field(
        "human",
        description="human: one readable line per event; json: one JSON object per line "
        "(time, level, logger, message, and the traceback if any) for log "
        "collectors.",
    )
