"""Late-joiner benchmark: seconds from `dtnode join --peer ...` to training in sync.

    .venv/bin/python -m tests.bench.late_join               # 10 MB and 100 MB checkpoints
    .venv/bin/python -m tests.bench.late_join --models mlp_100mb --trials 3

A donor node trains a model of the given size on loopback; a joiner process is started
with `--peer` and timed until it logs that it is in sync (its θ_g loaded from the donor's
checkpoint, verified). Process start-up (Python, torch, the DHT) is included: that is what
a user waits for. The reference is a raw aiohttp download of the same file from the same
sidecar, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes import NodeProcess  # noqa: E402

FLAGS = ["--inner-steps", "20", "--batch-size", "1", "--seq-len", "8", "--no-fused-kernels", "--keep-checkpoints", "3"]


def _meta(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/checkpoint", timeout=5) as resp:
        return json.load(resp)


async def raw_download(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    size = 0
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as resp:
            async for block in resp.content.iter_chunked(1 << 20):
                size += len(block)
    return time.perf_counter() - started, size


def run(model: str, trials: int) -> dict:
    spec = f"tests.bench.models:{model}"
    with tempfile.TemporaryDirectory() as tmp:
        donor = NodeProcess.join("donor", Path(tmp), "--model", spec, *FLAGS)
        try:
            url = donor.http_url
            deadline = time.monotonic() + 300
            while True:
                try:
                    meta = _meta(url)
                    break
                except OSError:
                    assert time.monotonic() < deadline, donor.output
                    time.sleep(0.5)
            joins, downloads, raws = [], [], []
            for trial in range(trials):
                started = time.monotonic()
                joiner = NodeProcess.join(f"joiner{trial}", Path(tmp), "--model", spec, *FLAGS, "--peer",
                                          donor.join_address, "--max-rounds", "1")
                try:
                    joiner.wait_for_line(r"in sync at outer step", timeout=300)
                    joins.append(time.monotonic() - started)
                    downloads.append(float(joiner.wait_for_line(r"downloaded checkpoint \d+ .* in ([\d.]+)s").group(1)))
                finally:
                    joiner.kill()
                meta = _meta(url)
                seconds, size = asyncio.run(raw_download(f"{url}/checkpoint/{meta['outer_step']}"))
                raws.append(seconds)
            return {"model": model, "size": meta["size_bytes"], "join": statistics.median(joins),
                    "download": statistics.median(downloads), "raw": statistics.median(raws)}
        finally:
            donor.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp_10mb,mlp_100mb", help="factories in tests/bench/models.py")
    parser.add_argument("--trials", type=int, default=3, help="joiners per model (median reported)")
    args = parser.parse_args()
    print(f"{'checkpoint':>10} {'start to in sync':>17} {'of it, download':>16} {'raw HTTP GET':>13}")
    for model in args.models.split(","):
        r = run(model, args.trials)
        print(f"{r['size'] / 1e6:8.1f}MB {r['join']:16.2f}s {r['download']:15.2f}s {r['raw']:12.2f}s", flush=True)


if __name__ == "__main__":
    main()
