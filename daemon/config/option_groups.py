"""How `dtnode join --help` presents the options: essentials first, knobs last.

Every field of NodeSettings belongs to exactly one group (a test checks it), so a new option
has to be placed deliberately. The last group, tuning and test knobs, is listed only by
`--help-all`: a newcomer reading `--help` sees what a node needs, not what a benchmark turns.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptionGroup:
    title: str
    description: str
    fields: tuple[str, ...]
    advanced: bool = False  # listed by --help-all only


OPTION_GROUPS: tuple[OptionGroup, ...] = (
    OptionGroup(
        "essentials",
        "Which swarm to join, what to train on, where state and ports live.",
        (
            "peers",
            "new_swarm",
            "data",
            "model",
            "tokenizer",
            "gpus",
            "device",
            "state_dir",
            "config",
            "announce_host",
            "host",
            "dht_port",
            "grpc_port",
            "http_port",
        ),
    ),
    OptionGroup(
        "access",
        "Who may average with this node, and how it is reached.",
        ("swarm_key_file", "require_swarm_key", "client_mode", "insecure_data_plane", "status_port", "status_host"),
    ),
    OptionGroup(
        "this host's training",
        "How this host computes its inner steps; peers may differ here.",
        ("precision", "batch_size", "nproc_per_node", "shard", "compile", "threads_per_rank", "bandwidth_mbps"),
    ),
    OptionGroup(
        "the swarm's recipe",
        "What every peer of a swarm shares. A joiner takes them from the swarm; set them only when starting a new one.",
        (
            "run_id",
            "seq_len",
            "inner_steps",
            "pacing",
            "round_tokens",
            "round_seconds",
            "overlap",
            "inner_lr",
            "lr_schedule",
            "warmup_steps",
            "total_steps",
            "min_lr_ratio",
            "outer_lr",
            "outer_momentum",
            "compression",
            "max_rounds",
        ),
    ),
    OptionGroup(
        "data and evaluation",
        "How the training data is read and the held-out loss measured.",
        ("text_field", "data_dtype", "eval_data", "eval_fraction", "eval_sequences", "eval_every"),
    ),
    OptionGroup(
        "averaging",
        "How groups form and how this node reduces its part.",
        ("target_group_size", "aggregation", "trim_fraction", "error_feedback", "max_lag", "min_peers", "join_timeout"),
    ),
    OptionGroup(
        "operation",
        "Checkpoints, health and logs.",
        ("checkpoint_every", "keep_checkpoints", "health_stall_s", "log_level", "log_format"),
    ),
    OptionGroup(
        "tuning and testing",
        "Knobs for benchmarks, tests and unusual networks; the defaults suit a swarm.",
        (
            "inner_weight_decay",
            "grad_clip",
            "seed",
            "grid_dims",
            "matchmaking_window",
            "matchmaking_window_min",
            "allreduce_timeout",
            "allreduce_timeout_min",
            "consensus_every",
            "quant_block_size",
            "chunk_elements",
            "in_flight_chunks",
            "fused_kernels",
            "sparse_block_size",
            "sparse_top_k",
            "feedback_decay",
            "heartbeat_interval",
            "peer_ttl",
            "max_own_rounds",
        ),
        advanced=True,
    ),
)
