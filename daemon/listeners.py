"""What a node opens to the world, and the checks before it does: the swarm key, the ports,
the gRPC server that reduces this node's parts and the HTTP sidecar.

Each start pushes its stop on the node's exit stack; a port or a key that cannot be had ends
the start with one SettingsError line naming the option, never a traceback.
"""

from __future__ import annotations

import contextlib

from dtnode.daemon.config.settings import NodeSettings, SettingsError
from dtnode.daemon.serve.presenter import NodePresenter
from dtnode.daemon.serve.sidecar import ServedSteps, Sidecar
from dtnode.daemon.telemetry.metrics import CountsCollector, NodeMetrics
from dtnode.peers.auth import ENV_KEY, AuthError, SwarmAuth, load_swarm_key
from dtnode.peers.reduction_registry import ReductionRegistry
from dtnode.peers.server import GrpcPortError, port_in_use, start_grpc_server
from dtnode.peers.service import AveragingService
from dtnode.peers.tls import TrustStore
from dtnode.peers.wire import max_message_bytes

REGISTRATION_WAIT_S = 5.0  # how long a reducer waits for a sender's group to form on its side
GRPC_STOP_GRACE_S = 5.0  # streams still open at stop get this long to finish (a reply to a slower member)


def swarm_key(s: NodeSettings) -> bytes | None:
    """The swarm key of --swarm-key-file or DTNODE_SWARM_KEY (None: an open swarm, refused
    with --require-swarm-key); a bad key file ends the start with one line."""
    try:
        key = load_swarm_key(
            str(s.security.swarm_key_file) if s.security.swarm_key_file else None,
            {ENV_KEY: s.security.swarm_key.get_secret_value()} if s.security.swarm_key else {},
        )
    except AuthError as e:
        raise SettingsError("--swarm-key-file", str(e)) from None
    if key is None and s.security.require_swarm_key:
        raise SettingsError(
            "--require-swarm-key",
            "no swarm key was given (--swarm-key-file or DTNODE_SWARM_KEY; in Kubernetes, the "
            "dtnode-swarm-key secret); refusing to start an open swarm",
        )
    return key


def check_ports(s: NodeSettings) -> None:
    """End at once, naming the option, when a port this node must listen on is taken."""
    wanted = [("--dht-port", s.network.dht_port, s.network.host), ("--http-port", s.network.http_port, s.network.host)]
    if not s.network.client_mode:
        wanted.append(("--grpc-port", s.network.grpc_port, s.network.host))
    if s.network.status_port:
        wanted.append(("--status-port", s.network.status_port, s.network.status_host))
    seen: dict[int, str] = {}
    for option, port, host in wanted:
        if not port:
            continue
        if port in seen:
            raise SettingsError(option, f"port {port} is also given to {seen[port]}; each needs its own")
        seen[port] = option
        if port_in_use(host, port):
            raise SettingsError(
                option,
                f"port {port} on {host} is in use (another dtnode on this host? give "
                f"each node its own ports, or 0 for any free one)",
            )


async def serve_averaging(
    stack: contextlib.AsyncExitStack,
    s: NodeSettings,
    registry: ReductionRegistry,
    auth: SwarmAuth | None,
    trust: TrustStore | None,
    metrics: NodeMetrics,
) -> int:
    """Start the gRPC server that reduces this node's parts (a client-mode node has none), its
    stop pushed on `stack`: the port it listens on."""
    service = AveragingService(
        registry,
        s.swarm.run_id,
        registration_wait=min(REGISTRATION_WAIT_S, s.averaging.matchmaking_window),
        auth=auth,
        trust=trust,
    )
    metrics.registry.register(
        CountsCollector(
            "dtnode_refused_streams", "Streams refused for what they carried, by reason", "reason", service.refused
        )
    )
    credentials = trust.server_credentials() if trust is not None else None
    try:
        server, grpc_port = await start_grpc_server(
            service,
            s.network.host,
            s.network.grpc_port,
            max_message_bytes(s.wire.chunk_elements),
            credentials=credentials,
        )
    except GrpcPortError as e:  # taken since the check at start
        raise SettingsError("--grpc-port", str(e)) from None
    stack.push_async_callback(server.stop, GRPC_STOP_GRACE_S)
    return grpc_port


async def serve_http(
    stack: contextlib.AsyncExitStack,
    s: NodeSettings,
    presenter: NodePresenter,
    served: ServedSteps,
    auth: SwarmAuth | None,
) -> tuple[int, str | None]:
    """Start the sidecar (and the status listener with --status-port), its stop pushed on
    `stack`: its port, and the status listener's URL (None: /status is on the sidecar's port)."""
    sidecar = Sidecar(presenter, served=served, auth=auth, separate_status=s.network.status_port is not None)
    stack.push_async_callback(sidecar.stop)
    return await _listen(sidecar, s)


async def _listen(sidecar: Sidecar, s: NodeSettings) -> tuple[int, str | None]:
    """Start the sidecar: its port, and the status listener's URL with --status-port (None:
    /status is on the sidecar's port). A port that cannot be had ends the start with one line."""
    try:
        http_port = await sidecar.start(s.network.host, s.network.http_port)
    except OSError as e:
        raise SettingsError(
            "--http-port", f"cannot listen on {s.network.host}:{s.network.http_port}: {e.strerror or e}"
        ) from None
    if s.network.status_port is None:
        return http_port, None
    try:
        status_port = await sidecar.start_status(s.network.status_host, s.network.status_port)
    except OSError as e:
        raise SettingsError(
            "--status-port", f"cannot listen on {s.network.status_host}:{s.network.status_port}: {e.strerror or e}"
        ) from None
    return http_port, f"http://{s.network.status_host}:{status_port}"
