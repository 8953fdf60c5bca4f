"""Late-joiner benchmark: seconds from `dtnode join --peer ...` to training in sync.

    .venv/bin/python -m tests.bench.late_join               # 10 MB and 100 MB checkpoints
    .venv/bin/python -m tests.bench.late_join --models mlp_100mb --trials 3
    .venv/bin/python -m tests.bench.late_join --in-rounds   # joiners at random moments of a running swarm

A donor node trains a model of the given size on loopback; a joiner process is started
with `--peer` and timed until it logs that it is in sync (its θ_g loaded from the donor's
checkpoint, verified). Process start-up (Python, torch, the DHT) is included: that is what
a user waits for. The reference is a raw aiohttp download of the same file from the same
sidecar, in the same run.

`--in-rounds`: two donors of the `small` preset train in rounds of about a minute (on a
2-core CPU host: H=3, the donors sharing one core and each joiner on the other, as a joiner on
its own box would be; `--shared-cpus` runs them all on every core), and joiners are started one
at a time at random moments of a round (inner steps, averaging and the outer phase alike). For each it prints the donors' phase
at the joiner's start, the seconds from start to its first inner step in step with the
swarm, the download's share (`download`: the transfers, summed when a round closed during
the first and the joiner fetched the next; `fetch`: from each "downloading" line to "in sync",
which adds the donors writing the file on demand, verification and installation), the
seconds to its first round averaged with both donors, the round it trained with them
(`reentered`: 1 when it arrived in a round's last seconds and the donors averaged that round
before its first step was done, so it took the next round's θ_g), and whether any of its
rounds was trained alone or any donor dropped a connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes import NodeProcess

FLAGS = ["--inner-steps", "20", "--batch-size", "1", "--seq-len", "8", "--no-fused-kernels", "--keep-checkpoints", "3"]


def _meta(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/checkpoint", timeout=5) as resp:
        return json.load(resp)


async def raw_download(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    size = 0
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
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
                joiner = NodeProcess.join(
                    f"joiner{trial}",
                    Path(tmp),
                    "--model",
                    spec,
                    *FLAGS,
                    "--peer",
                    donor.join_address,
                    "--max-own-rounds",
                    "1",
                )
                try:
                    joiner.wait_for_line(r"in sync at outer step", timeout=300)
                    joins.append(time.monotonic() - started)
                    downloads.append(float(joiner.wait_for_line(r"downloaded checkpoint \d+ .* in ([\d.]+)s").group(1)))
                finally:
                    joiner.kill()
                meta = _meta(url)
                seconds, _size = asyncio.run(raw_download(f"{url}/checkpoint/{meta['outer_step']}"))
                raws.append(seconds)
            return {
                "model": model,
                "size": meta["size_bytes"],
                "join": statistics.median(joins),
                "download": statistics.median(downloads),
                "raw": statistics.median(raws),
            }
        finally:
            donor.kill()


ROUND_LINE = re.compile(r"round (\d+) \| groups (\d+)/(\d+)")


def _phase(node: NodeProcess) -> str:
    try:
        status = node.get("/status")
    except OSError:
        return "?"
    return f"{status['phase']}@{status['outer_step']}"


def _full_round(line: str) -> str | None:
    m = ROUND_LINE.search(line)
    return m.group(1) if m is not None and m.group(2) == m.group(3) == "3" else None


def _fetch_seconds(joiner: NodeProcess) -> float | None:
    """From each "downloading a checkpoint" line to its "in sync" line, summed: the transfer and
    the donors writing the file on demand, verification and installation included."""
    total, began = 0.0, None
    for t, line in zip(joiner.times, joiner.lines):
        if "downloading a checkpoint" in line:
            began = t
        elif "in sync at outer step" in line and began is not None:
            total, began = total + t - began, None
    return total or None


def _last(pattern: str, text: str) -> re.Match | None:
    matches = list(re.finditer(pattern, text))
    return matches[-1] if matches else None


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def _cpu_sets(separate: bool) -> tuple[list[str], list[str]]:
    """Command prefixes for the donors and the joiners: with `separate`, the joiner gets CPUs of
    its own (as a joiner on its own box has), the donors share the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    if not separate or len(cpus) < 2 or shutil.which("taskset") is None:
        return [], []
    half = len(cpus) // 2
    return (["taskset", "-c", ",".join(map(str, cpus[:half]))], ["taskset", "-c", ",".join(map(str, cpus[half:]))])


def run_in_rounds(model: str, trials: int, inner_steps: int, batch: int, seed: int, keep: Path, separate: bool) -> None:
    """Joiners started at random moments of a running 2-donor swarm (see the module docstring)."""
    keep.mkdir(parents=True, exist_ok=True)
    donor_cpus, joiner_cpus = _cpu_sets(separate)
    flags = [
        "--model",
        model,
        "--inner-steps",
        str(inner_steps),
        "--batch-size",
        str(batch),
        "--no-fused-kernels",
        "--join-timeout",
        "300",
        "--matchmaking-window",
        "30",
    ]
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        donors = [NodeProcess.join("d0", Path(tmp), *flags, "--min-peers", "2", prefix=donor_cpus)]
        try:
            donors.append(
                NodeProcess.join(
                    "d1", Path(tmp), *flags, "--min-peers", "2", "--peer", donors[0].join_address, prefix=donor_cpus
                )
            )
            _, first_end, index = donors[0].wait_for_line_at(r"round 0 \| groups", timeout=1200)
            _, second_end, index = donors[0].wait_for_line_at(r"round 1 \| groups", timeout=1200, after=index + 1)
            period = second_end - first_end
            cpus = (
                f"donors on CPUs {donor_cpus[-1]}, each joiner on CPUs {joiner_cpus[-1]}"
                if donor_cpus
                else "donors and joiners sharing every CPU"
            )
            print(
                f"2 donors of {model}, H={inner_steps}, batch {batch}, {cpus}: a round takes {period:.0f}s here",
                flush=True,
            )
            print(
                f"{'trial':>5} {'at':>6} {'donors':>14} {'to in step':>11} {'download':>9} {'fetch':>7} {'to averaged':>12} "
                f"{'round':>6} {'reentered':>9} {'alone':>6} {'dropped':>8}  target",
                flush=True,
            )
            met = 0
            for trial in range(trials):
                # the next round end from now on (an older line would start the joiner at once, where
                # the previous trial left the donors, and no longer at a random moment of a round)
                _, end, index = donors[0].wait_for_line_at(ROUND_LINE.pattern, timeout=1200, after=len(donors[0].lines))
                offset = rng.uniform(0, period)
                time.sleep(max(0.0, end + offset - time.monotonic()))
                phase = _phase(donors[0])
                started = time.monotonic()
                joiner = NodeProcess.join(
                    f"j{trial}",
                    Path(tmp),
                    *flags,
                    "--peer",
                    donors[0].join_address,
                    "--max-own-rounds",
                    "1",
                    prefix=joiner_cpus,
                )
                try:
                    joiner.wait(900)
                finally:
                    joiner.kill()
                    (keep / f"{joiner.name}.log").write_text(joiner.output)
                out = joiner.output
                entered = in_step = download = averaged_at = None
                # the last round entered: a joiner that arrived in a round's last seconds, whose peers
                # averaged it before the joiner's first step was done, drops it and enters the next
                # (a node of a version before this line existed: the moment it said it was in sync)
                if (
                    m := _last(r"training round (\d+) with the swarm", out)
                    or _last(r"in sync at outer step (\d+)", out)
                ) is not None:
                    entered = int(m.group(1))
                    in_step = next(t for t, line in zip(joiner.times, joiner.lines) if m.group(0) in line)
                # every transfer counts (a round that closed during the first sends the joiner for the next)
                transfers = [float(t) for t in re.findall(r"downloaded checkpoint \d+ .* in ([\d.]+)s", out)]
                download = sum(transfers) if transfers else None
                fetch = _fetch_seconds(joiner)
                full = [
                    (int(r), t) for t, line in zip(joiner.times, joiner.lines) if (r := _full_round(line)) is not None
                ]
                if full:
                    averaged_at = full[0][1]
                rounds = [(int(r), int(g)) for r, g, _ in ROUND_LINE.findall(out)]
                alone = sum(1 for _, g in rounds if g == 1)
                dropped = len(re.findall(r"dropped the connection|donor \S+ failed", out))
                late = len(re.findall(r"closed while this node took its first", out))
                to_step = None if in_step is None else in_step - started
                ok = (
                    to_step is not None
                    and download is not None
                    and to_step <= 10 + download
                    and full
                    and full[0][0] == entered
                    and not alone
                    and not dropped
                    and "Traceback" not in out
                )
                met += bool(ok)
                print(
                    f"{trial:>5} {offset:5.0f}s {phase:>14} {_s(to_step):>11} {_s(download):>9} {_s(fetch):>7} "
                    f"{_s(averaged_at and averaged_at - started):>12} {entered if entered is not None else '-':>6} "
                    f"{late:>9} {alone:>6} {dropped:>8}  {'met' if ok else 'MISSED'}",
                    flush=True,
                )
            for donor in donors:
                (keep / f"{donor.name}.log").write_text(donor.output)
            tracebacks = [d.name for d in donors if "Traceback" in d.output]
            print(
                f"{met}/{trials} trials met every target (in step within 10 s plus the download, in the very next "
                f"averaging, no round alone, no dropped connection); donor tracebacks: {tracebacks or 'none'}; "
                f"logs in {keep}"
            )
        finally:
            for donor in donors:
                donor.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp_10mb,mlp_100mb", help="factories in tests/bench/models.py")
    parser.add_argument(
        "--trials", type=int, default=3, help="joiners per model (median reported; with --in-rounds, 10 unless given)"
    )
    parser.add_argument("--in-rounds", action="store_true", help="joiners at random moments of a running swarm")
    parser.add_argument("--model", default="small", help="--in-rounds: the donors' and joiners' model")
    parser.add_argument("--inner-steps", type=int, default=3, help="--in-rounds: H")
    parser.add_argument(
        "--shared-cpus",
        action="store_true",
        help="--in-rounds: run the joiners on the donors' "
        "CPUs (by default a joiner gets half of this host's CPUs to itself, as on its own box)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="--in-rounds: sequences per inner step")
    parser.add_argument("--seed", type=int, default=0, help="--in-rounds: seed of the joiners' start moments")
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=Path(tempfile.gettempdir()) / "dtnode-late-join",
        help="--in-rounds: where every node's log is written",
    )
    args = parser.parse_args()
    if args.in_rounds:
        trials = args.trials if "--trials" in sys.argv else 10
        run_in_rounds(
            args.model, trials, args.inner_steps, args.batch_size, args.seed, args.keep_logs, not args.shared_cpus
        )
        return
    print(f"{'checkpoint':>10} {'start to in sync':>17} {'of it, download':>16} {'raw HTTP GET':>13}")
    for model in args.models.split(","):
        r = run(model, args.trials)
        print(f"{r['size'] / 1e6:8.1f}MB {r['join']:16.2f}s {r['download']:15.2f}s {r['raw']:12.2f}s", flush=True)


if __name__ == "__main__":
    main()
