"""The node's gRPC server: hosts the averaging service on one port."""

from __future__ import annotations

import errno
import socket

import grpc

from dtnode.proto import averaging_pb2_grpc as pb_grpc

from .service import AveragingService


class GrpcPortError(OSError):
    """The gRPC port could not be bound (in use, or no permission)."""


async def start_grpc_server(
    service: AveragingService,
    host: str,
    port: int,
    max_message_bytes: int,
    max_concurrent_streams: int = 64,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start serving (over TLS with `credentials`); returns the server and the bound port (useful when port is 0)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_concurrent_streams", max_concurrent_streams),
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_AveragingServicer_to_server(service, server)
    bind_host = f"[{host}]" if ":" in host else host
    try:
        address = f"{bind_host}:{port}"
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:
        raise GrpcPortError(f"cannot bind gRPC port {host}:{port}: {e}") from e
    if bound == 0:
        raise GrpcPortError(f"cannot bind gRPC port {host}:{port}")
    await server.start()
    return server, bound


def port_in_use(host: str, port: int) -> bool:
    """Whether another process listens on host:port (a bind without SO_REUSEPORT fails then,
    even against a listener that set it). Checked before a node starts anything, so a clash
    ends it at once with the option to change, not later with a daemon's opaque error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to listen on
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False
