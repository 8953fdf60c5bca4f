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
