"""What an attacker on the path does to one TCP connection: forward it, flipping one byte once."""

from __future__ import annotations

import asyncio
import threading


async def forward(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter,
    flip_at: int | None = None,
    flipped: threading.Event | None = None,
) -> None:
    """Copy `src` to `dst` until either end closes; with `flip_at`, flip one bit of the byte at
    that offset of this connection, unless `flipped` says some connection already had its byte."""
    seen = 0
    try:
        while data := await src.read(1 << 16):
            if flip_at is not None and flipped is not None and not flipped.is_set() and seen + len(data) > flip_at:
                data = bytearray(data)
                data[flip_at - seen] ^= 0x20
                flipped.set()
            seen += len(data)
            dst.write(bytes(data))
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        dst.close()


class FlippingProxy:
    """A TCP proxy on the path that flips one byte of the client's stream at `offset`."""

    def __init__(self, target_port: int, offset: int):
        self.target_port, self.offset, self.flipped_event = target_port, offset, threading.Event()
        self.connections = 0  # accepted from the client, each forwarded on its own upstream connection

    @property
    def flipped(self) -> bool:
        return self.flipped_event.is_set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader, writer):
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(forward(reader, up_writer, self.offset, self.flipped_event), forward(up_reader, writer))
