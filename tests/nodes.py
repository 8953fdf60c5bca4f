"""Real `dtnode` processes on loopback for multi-node tests."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")
PORTS = ["--dht-port", "0", "--grpc-port", "0", "--http-port", "0"]


def step_floor(seconds: float) -> dict[str, str]:
    """The environment that makes every inner step of a node take at least `seconds`, for a test
    that times a restart or a join against the swarm's rounds. On a GPU host a tiny-model step
    takes milliseconds and a process's start takes longer than on CI's 2 cores (CUDA starts
    too): without a floor the swarm runs a dozen rounds while the process starts."""
    return {"DTNODE_TEST_STEP_FLOOR_S": str(seconds)}


def time_paced_swarm(n: int, rounds: int, round_seconds: float, group_size: int, join_timeout: float) -> list[str]:
    """Arguments of one node of a swarm of `n` tiny nodes whose rounds are paced by time (each
    round's inner steps end after `round_seconds`, the tokens asked for are out of reach), with
    groups of `group_size` on the default moshpit grid: what the scale bench and the 16-node
    swarm test start, so that the cost of many nodes, not their training, is what they see."""
    return [
        "--model",
        "tiny",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--inner-steps",
        "1000",
        "--round-tokens",
        str(10**12),  # out of reach: --round-seconds ends each round
        "--round-seconds",
        f"{round_seconds:g}",
        "--max-rounds",
        str(rounds),
        "--min-peers",
        str(n),
        "--target-group-size",
        str(group_size),
        "--eval-every",
        "0",
        "--checkpoint-every",
        "5",
        "--join-timeout",
        f"{join_timeout:g}",
        "--no-fused-kernels",
    ]


# Small and quick: the tiny preset, short rounds, short timeouts, eager int8 kernels, and the
# default inner optimizer (Muon).
FAST_DEFAULT_OPTIMIZER = [
    "--model",
    "tiny",
    "--inner-steps",
    "15",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--keep-checkpoints",
    "100",
    "--checkpoint-every",
    "1",
    "--matchmaking-window",
    "10",
    # a record outlives a beat and the 3 s a store's search waits on a DHT peer that never answers
    # (a paused node: peers/membership.py `Membership.heartbeat`)
    "--peer-ttl",
    "5",
    "--heartbeat-interval",
    "1",
    "--no-fused-kernels",
]
# The same with AdamW, for the swarms whose subject is not the optimizer: on a 2-core CPU a tiny
# step with Muon costs nearly twice AdamW's (its Newton-Schulz iterations cost about what the
# forward and backward passes of a 256-token batch do), which took the default suite over its
# 10 minutes (569 s and 607 s in CI, against 496 s).
# Muon's swarms: test_inner_optimizer_swarm, the multi-rank hosts, the README's commands.
FAST = [*FAST_DEFAULT_OPTIMIZER, "--inner-optimizer", "adamw"]


def dtnode_status(url: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`dtnode status --url URL` as a user runs it (the environment given, or this one), in a
    terminal wide enough for every column of its tables."""
    return subprocess.run(
        [sys.executable, "-m", "dtnode", "status", "--url", url, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**(os.environ if env is None else env), "COLUMNS": "200"},
    )


def typed_at_a_terminal(command: str) -> list[str]:
    """The argv that runs the shell `command` with SIGINT at its default, as a terminal's
    foreground job has it. A runner started in the background (`make test &`) hands SIGINT down
    ignored, and exec, like Python, keeps an ignored signal ignored: a test's Ctrl-C then did
    nothing (this box's CI20). Python resets it here, then execs bash, which keeps a default."""
    reset_then_exec = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execvp('bash', ['bash', '-c', sys.argv[1]])"
    )
    return [sys.executable, "-c", reset_then_exec, command]


def wait_until(condition: Callable[[], T | None], timeout: float, what: str | Callable[[], str]) -> T:
    """Poll `condition` until it returns something truthy; AssertionError naming `what` after
    `timeout` seconds (a hang guard: generous, never a speed check). A callable `what` is asked
    at the timeout: a node's output then, not when the wait began."""
    deadline = time.monotonic() + timeout
    while True:
        if value := condition():
            return value
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"no {said} within {timeout:.0f}s")
        time.sleep(0.2)


def written(path: Path, timeout: float = 60) -> Path:
    """`path` once a node has written it. A round's checkpoint is written in the background: its
    history entry (what tests wait on) can come first, and the file, renamed into place whole, a
    moment later."""
    wait_until(path.exists, timeout, f"{path} written")
    return path


def theta(state_dir: Path, step: int):
    """θ_g of a node's checkpoint at `step`, flat (once it is written)."""
    import torch
    from safetensors.torch import load_file

    from dtnode.daemon.checkpoints.file_format import checkpoint_path

    tensors = load_file(str(written(checkpoint_path(state_dir, step))))
    return torch.cat([t.reshape(-1) for name, t in sorted(tensors.items()) if name.startswith("theta_g/")])


class NodeProcess:
    # every node the running test started: a failed test's report ends with each one's last lines
    # (conftest.py), so a failure in CI, where no log dir survives, says what the nodes were doing
    started: ClassVar[list[NodeProcess]] = []

    def __init__(
        self, name: str, args: list[str], state_dir: Path, env: dict | None = None, prefix: list[str] | None = None
    ):
        self.name = name
        self.state_dir = state_dir
        # a history.jsonl entry's `time` tells this process's rounds from a restart's before and after it
        self.started_at = time.time()
        self.ended_at = math.inf  # when its output closed: it exited
        self.lines: list[str] = []
        self.times: list[float] = []  # time.monotonic() at which each line was read
        # `prefix` wraps the command, e.g. `ip netns exec NS` (which execs it: signals reach the node).
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-u", "-m", "dtnode", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "GRPC_VERBOSITY": "ERROR", **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        NodeProcess.started.append(self)

    def _read(self) -> None:
        # DTNODE_TEST_LOG_DIR keeps every node's whole log, for reading after a run (tests/bench/gpu.sh
        # counts the tracebacks in them): a test shows a node's output only when it fails.
        log_dir = os.environ.get("DTNODE_TEST_LOG_DIR")
        if log_dir:  # made here: a directory that is not there would kill this reader, and the test with it
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        log = open(Path(log_dir) / f"{self.name}-{self.proc.pid}.log", "w", buffering=1) if log_dir else None  # noqa: SIM115
        try:
            for line in self.proc.stdout:
                self.times.append(time.monotonic())
                self.lines.append(line.rstrip())
                if log is not None:
                    log.write(line)
        finally:
            self.ended_at = time.time()
            if log is not None:
                log.close()

    @classmethod
    def join(
        cls,
        name: str,
        tmp: Path,
        *extra: str,
        env: dict | None = None,
        host: str = "127.0.0.1",
        prefix: list[str] | None = None,
    ) -> NodeProcess:
        """`dtnode join` in `tmp / name`. Its --join-timeout is 120 s unless given: a first node
        waiting for --min-peers gives up after it and trains alone, and on a busy CI host joiners
        have come up more than 30 s (the default) after it (a test then failed on a's lone
        rounds); a joiner dials its --peer until then. The wait ends as soon as the peers are in."""
        state_dir = tmp / name
        if "--join-timeout" not in extra:
            extra = (*extra, "--join-timeout", "120")
        if "--peer" not in extra:  # the first node of a test's swarm (or one restarted alone)
            extra = (*extra, "--new-swarm")
        return cls(
            name, ["join", "--host", host, *PORTS, "--state-dir", str(state_dir), *extra], state_dir, env, prefix
        )

    def wait_for_line(self, pattern: str, timeout: float = 60) -> re.Match:
        return self.wait_for_line_at(pattern, timeout)[0]

    def wait_for_line_at(self, pattern: str, timeout: float = 60, after: int = 0) -> tuple[re.Match, float, int]:
        """The first line from index `after` on that matches, when it was read (monotonic), and its index."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = after
        while time.monotonic() < deadline:
            upto = len(self.lines)
            for index in range(seen, upto):
                if m := regex.search(self.lines[index]):
                    return m, self.times[index], index
            seen = upto  # lines are appended whole: each is searched once
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no line matching {pattern!r}; output:\n" + self.output)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    @property
    def join_address(self) -> str:
        return self.wait_for_line(r"dtnode join --peer (\S+)").group(1)

    @property
    def http_url(self) -> str:
        return self.wait_for_line(r"status (http://\S+)/status").group(1)

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.http_url + path, timeout=5) as resp:
            return resp.read().decode()

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.http_url + path, timeout=5) as resp:
            return json.load(resp)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0.0 while the node does not answer, or has not counted it)."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = self.get_text("/metrics")
        except (OSError, ValueError):
            return 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return 0.0

    def status(self) -> dict[str, Any] | None:
        """/status, or None while the node does not answer."""
        try:
            return self.get("/status")
        except (OSError, ValueError):
            return None

    def in_step_at(self, timeout: float = 60) -> int:
        """The outer step a starting node trains from once it is in step with its swarm (after
        a download, or from its own checkpoint): its /status once it has left joining and
        syncing. The step moves only when its first round ends, later than a poll."""

        def training() -> dict[str, Any] | None:
            status = self.status()
            return status if status and status["state"] in ("training", "averaging") else None

        return int(
            wait_until(training, timeout, lambda: f"{self.name} in step; output:\n{self.output[-6000:]}")["outer_step"]
        )

    @property
    def rounds(self) -> list[dict[str, Any]]:
        """The node's rounds as `/history` serves them, from the file behind it in the state dir
        (readable after the node exits): one entry per round, oldest first, each with its
        `round`, `step`, `groups` ([[size, expected], ...] per hop), `inner_steps`, `tokens`,
        `params_sha256`, `eval_loss` and `outcome`. A restarted node's earlier rounds come first."""
        try:
            text = (self.state_dir / "history.jsonl").read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # the line being written
                continue
        return out

    @property
    def own_rounds(self) -> list[dict[str, Any]]:
        """The rounds this process ended (`rounds` without those of the node's other processes on
        its state dir: before a restart, or after it for the process that was killed)."""
        return [r for r in self.rounds if self.started_at <= r["time"] <= self.ended_at]

    def rounds_summary(self) -> str:
        """One line per round this node recorded: what a failed test's report shows of it, where
        CI keeps no state dir and a log's last lines say little of its first rounds."""
        return "\n".join(
            f"round {r['round']} step {r['step']} {r['outcome']} groups {r['groups']} steps {r['inner_steps']} "
            f"lr {r['lr']:.3g} bounded {r.get('bounded', [])} synced {[a['source'] for a in r.get('synced', [])]} "
            f"reasons {r.get('reasons', [])} params {r['params_sha256'][:12]}"
            for r in self.rounds
        )

    def round(self, number: int) -> dict[str, Any] | None:
        """The newest entry of round `number` (None if it has not ended here)."""
        return next((r for r in reversed(self.rounds) if r["round"] == number), None)

    def wait_for_round(
        self, condition: Callable[[dict[str, Any]], bool] = lambda r: True, timeout: float = 120, after: int = 0
    ) -> dict[str, Any]:
        """The first round (from index `after` of `rounds`) that satisfies `condition`."""

        def found() -> dict[str, Any] | None:
            return next((r for r in self.rounds[after:] if condition(r)), None)

        return wait_until(found, timeout, lambda: f"round of {self.name} as asked; output:\n{self.output[-6000:]}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit in {timeout}s; output:\n{self.output}") from None
        self._reader.join(10)  # its last lines are read: `output` is whole once the process exited
        return code

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_swarm(first: NodeProcess, others, timeout: float = 3600) -> list[NodeProcess]:
    """Start `others(join address)` through the first node, wait until every node exits 0
    (RuntimeError with its log otherwise), and kill whatever is left on the way out."""
    nodes = [first]
    try:
        address = first.wait_for_line(r"dtnode join --peer (\S+)", 600).group(1)  # a busy host starts slowly
        nodes += others(address)
        for node in nodes:
            if node.wait(timeout) != 0:
                raise RuntimeError(f"{node.name} failed:\n{node.output[-4000:]}")
    finally:
        for node in nodes:
            node.kill()
    return nodes
