"""One long-lived gRPC channel per peer, renewed after a broken stream, closed when its peer leaves."""

from __future__ import annotations

import asyncio
import time

import grpc

from dtnode.proto import averaging_pb2_grpc as pb_grpc

from .tls import TLS_NAME, TlsError, TrustStore

RETIRING_WAIT_S = 1.0  # a stopping node waits this long for renewed channels to finish closing
RETIRING_GRACE_S = 30.0  # a channel dropped from the pool lets its open streams end within this
MAX_CHANNELS = 512  # channels pooled at once (one per peer): the least recently used goes first


class ChannelPool:
    """One long-lived gRPC channel per peer address (and, with TLS, per pinned certificate).

    A stream that broke on the transport is sent again on a channel dialled afresh (`renew`):
    sent at once on the old one it may still be given the connection that just broke (gRPC
    notices a peer's close a moment after the stream that saw it fails), and then breaks too.
    Each channel keeps its own connections, so a renewed one cannot be handed the old one's."""

    def __init__(self, max_message_bytes: int, trust: TrustStore | None = None):
        self.options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            # its own connections: gRPC's global pool would hand a renewed channel the old one's
            ("grpc.use_local_subchannel_pool", 1),
        ]
        self.trust = trust
        # by (address, pin), least recently used first; one per peer: a peer announcing another
        # address (or certificate) has its old channel closed, so nobody fills the pool
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._peer_of: dict[tuple[str, str], str] = {}
        self._retiring: set[asyncio.Task] = set()

    def _key(self, address: str, peer_id: str) -> tuple[str, str]:
        pin = ""
        if self.trust is not None:
            pin = self.trust.fingerprint_of(peer_id) or ""
            if not pin:
                raise TlsError(f"no TLS certificate known for peer {peer_id}")
        return address, pin

    def stub(self, address: str, peer_id: str) -> pb_grpc.AveragingStub:
        """A stub for `peer_id` at `address`; with TLS it trusts only that peer's certificate
        (TlsError if its record has not been read)."""
        return pb_grpc.AveragingStub(self._channel(address, peer_id))

    def _channel(self, address: str, peer_id: str) -> grpc.aio.Channel:
        key = self._key(address, peer_id)
        channel = self._channels.pop(key, None)
        if channel is None:
            for old in [k for k, p in self._peer_of.items() if p == peer_id]:
                self._retire(old, RETIRING_GRACE_S)
            while len(self._channels) >= MAX_CHANNELS:
                self._retire(next(iter(self._channels)), RETIRING_GRACE_S)
            if self.trust is None:
                channel = grpc.aio.insecure_channel(address, options=self.options)
            else:
                channel = grpc.aio.secure_channel(
                    address,
                    self.trust.channel_credentials(peer_id),
                    options=self.options + [("grpc.ssl_target_name_override", TLS_NAME)],
                )
        self._channels[key] = channel  # the most recently used last
        self._peer_of[key] = peer_id
        return channel

    def retain(self, live: set[str]) -> None:
        """Close the channels of peers no live record names (they end once their streams do)."""
        for key in [k for k, p in self._peer_of.items() if p not in live]:
            self._retire(key, RETIRING_GRACE_S)

    def _retire(self, key: tuple[str, str], grace: float) -> None:
        channel = self._channels.pop(key, None)
        self._peer_of.pop(key, None)
        if channel is not None:
            task = asyncio.ensure_future(channel.close(grace=grace))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    @property
    def size(self) -> int:
        """Channels pooled now."""
        return len(self._channels)

    async def dialable(self, address: str, peer_id: str, within: float) -> bool | None:
        """Whether this node can connect to the peer: False when the connection failed (refused,
        reset, or its TLS handshake) within `within` seconds, True once connected, None when it
        is still connecting then (a slow link proves nothing) or the peer's certificate is not
        known. The peer's pooled channel is the one dialled: a live peer is usually connected."""
        try:
            channel = self._channel(address, peer_id)
        except TlsError:
            return None
        deadline = time.monotonic() + within
        state = channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY:
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                return False
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), deadline - time.monotonic())
            except TimeoutError:
                return None
            state = channel.get_state(try_to_connect=True)
        return True

    def renew(self, address: str, peer_id: str, grace: float) -> None:
        """The next stub for this peer dials a new connection; streams still open on the old
        channel get `grace` seconds to end before it closes."""
        self._retire(self._key(address, peer_id), grace)

    async def close(self) -> None:
        channels, self._channels, self._peer_of = list(self._channels.values()), {}, {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
        if self._retiring:  # a renewed channel's streams end with the rounds; a stuck one may not delay a stop
            await asyncio.wait(self._retiring, timeout=RETIRING_WAIT_S)
