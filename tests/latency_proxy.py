"""A TCP relay that holds every byte for a fixed time: link latency where `tc netem` is missing.

    python tests/latency_proxy.py --delay-ms 50 --route 10.1.0.3:7701=10.1.0.2:7701 [--route ...]

Each route listens on the left address and relays every accepted connection to the right one.
Data read at time t is written at t + delay in each direction, so a connection through one relay
sees a round-trip time of twice the delay. Reading never waits for the delay (only for a bounded
buffer), so the relay adds latency without capping throughput: a link's rate stays what the
token bucket on it (tc tbf) says, and a window-limited protocol feels the bandwidth-delay
product as it would on a long link. Prints `ready` once every route listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

CHUNK = 1 << 18
QUEUED_CHUNKS = 256  # at most 64 MiB held per direction


async def _relay(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED_CHUNKS)

    async def read() -> None:
        try:
            while data := await src.read(CHUNK):
                await queue.put((time.monotonic() + delay, data))
        except (ConnectionError, OSError):
            pass
        await queue.put((time.monotonic() + delay, b""))

    reader = asyncio.ensure_future(read())
    try:
        while True:
            due, data = await queue.get()
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            if not data:
                if dst.can_write_eof():
                    dst.write_eof()
                break
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError, RuntimeError):  # RuntimeError: uvloop's write to a closed transport
        pass
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def _serve(listen: tuple[str, int], target: tuple[str, int], delay: float) -> asyncio.Server:
    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_relay(reader, up_writer, delay), _relay(up_reader, writer, delay))
        for w in (writer, up_writer):
            w.close()

    return await asyncio.start_server(accept, *listen, reuse_address=True)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added in each direction")
    parser.add_argument("--route", action="append", required=True, help="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    args = parser.parse_args()
    servers = []
    for route in args.route:
        listen, _, target = route.partition("=")
        servers.append(await _serve(_address(listen), _address(target), args.delay_ms / 1000))
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
