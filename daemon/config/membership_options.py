"""The options of who this node trains with: the swarm it joins, how it is reached, who may enter.

Each class is one group of NodeSettings (config/settings.py) and one section of `dtnode join
--help`; the field names are the flags' and the DTNODE_* variables' (--run-id, DTNODE_RUN_ID).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from dtnode.daemon.config.option_group import OptionGroup

_RUN_ID = re.compile(r"^[A-Za-z0-9._-]+$")


class SwarmOptions(OptionGroup):
    """The run this node belongs to, the peers it enters through, and how it keeps its place among them."""

    TITLE: ClassVar[str] = "swarm"
    HELP: ClassVar[str] = "Which swarm to join, and how membership is kept and caught up with."
    ADVANCED: ClassVar[frozenset[str]] = frozenset({"heartbeat_interval", "peer_ttl"})

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
    heartbeat_interval: float = Field(
        2.0,
        gt=0,
        le=60,
        description="Seconds between membership heartbeats in a swarm of up to 8 peers; n/8 times that "
        "with n peers above (each beat brings every record back: a node's DHT traffic stays flat as n grows).",
    )
    peer_ttl: float = Field(
        6.0,
        gt=0,
        le=600,
        description="Seconds a membership record lives without a heartbeat, stretched with the heartbeat "
        "above 8 peers.",
    )

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

    @model_validator(mode="after")
    def _heartbeats_within_the_ttl(self) -> SwarmOptions:
        if self.peer_ttl <= self.heartbeat_interval:
            raise ValueError("peer_ttl: must be longer than --heartbeat-interval")
        return self


class NetworkOptions(OptionGroup):
    """Interfaces, ports and the addresses peers use: what a firewall, a NAT or a cluster needs to know."""

    TITLE: ClassVar[str] = "network"
    HELP: ClassVar[str] = "Where this node listens and how peers reach it."
    ADVANCED: ClassVar[frozenset[str]] = frozenset()

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
    bandwidth_mbps: float = Field(
        1000.0, gt=0, description="This node's bandwidth in Mbit/s, used to size the part it reduces."
    )


class SecurityOptions(OptionGroup):
    """The swarm key and the data plane's encryption: what keeps outsiders out of a closed swarm."""

    TITLE: ClassVar[str] = "security"
    HELP: ClassVar[str] = "Who may average with this node and download its state."
    ADVANCED: ClassVar[frozenset[str]] = frozenset()

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
