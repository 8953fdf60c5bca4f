"""Chaos harness: real node processes on loopback, faults injected at a named (node, round,
phase), and the swarm's promises checked after each one.

A fault is keyed by the victim's `/status` phase (inner, matchmaking, allreduce, outer) at a
given outer step, or by a checkpoint temp file appearing in its state dir; the harness
polls, strikes, and records what it saw at that moment, so a report can say the injection
actually fired (the victim was in that phase and had not finished that round). Faults too
quick to hit by polling (dying between a sender's chunks, or with results owed) use a
failpoint armed in the victim's environment (peers/failpoints.py), which logs as it fires.
Network faults put the victim in its own network namespace behind one veth link
(chaos/netns.py) and cut or throttle that link.

Checks after each trial (what ARCHITECTURE.md promises):
- no survivor's round took longer than its inner steps plus d x (window + all-reduce timeout);
- no NaN or Inf in any θ_g any node wrote;
- survivors' θ_g agree within the int8 error after the next full mixing;
- the eval loss kept falling;
- every checkpoint on disk is whole (loadable), none lost;
- no node's log, a victim's included, holds a traceback (a round's failure is a logged value).
"""

from __future__ import annotations

import itertools
import json
import math
import signal
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from chaos.netns import IsolatedHost
from nodes import FAST, NodeProcess, theta

from dtnode.daemon.checkpoints.file_format import list_checkpoints
from dtnode.peers.failpoints import ENV as FAILPOINT_ENV

WINDOW, TIMEOUT = 6.0, 8.0
# A 10 MB model: its all-reduce and checkpoint writes last long enough to be struck mid-way.
FLAGS = [
    *FAST,
    "--model",
    "tests.bench.models:mlp_10mb",
    "--inner-steps",
    "10",
    "--matchmaking-window",
    str(WINDOW),
    "--allreduce-timeout",
    str(TIMEOUT),
    "--peer-ttl",
    "3",
    "--heartbeat-interval",
    "1",
    "--max-lag",
    "0",
]


def _status(node: NodeProcess, timeout: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(node.http_url + "/status", timeout=timeout) as resp:
            return json.load(resp)
    except (OSError, ValueError):
        return None


@dataclass
class Trial:
    scenario: str
    passed: bool = False
    fired: str = ""
    worst_round_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    victims: set[str] = field(default_factory=set)  # their own stalled rounds do not count


class Swarm:
    """N nodes; with `isolate_last`, the last one runs in its own network namespace behind
    `self.link` (a veth pair the harness can cut or throttle) and the rest bind the host end."""

    def __init__(
        self,
        tmp: Path,
        n: int,
        extra: list[str] | None = None,
        isolate_last: bool = False,
        last_env: dict | None = None,
    ):
        self.tmp = tmp
        self.extra = extra or []
        self.nodes: list[NodeProcess] = []
        self.gone: list[NodeProcess] = []
        self.link = IsolatedHost() if isolate_last else None
        self.host = self.link.host_ip if self.link else "127.0.0.1"
        try:
            first = self.start("n0", "--min-peers", str(n))
            self.address = first.join_address
            for i in range(1, n):
                last = i == n - 1
                self.start(
                    f"n{i}",
                    "--min-peers",
                    str(n),
                    "--peer",
                    self.address,
                    isolated=last and self.link is not None,
                    env=last_env if last else None,
                )
        except BaseException:
            self.kill_all()
            raise

    def start(self, name: str, *args: str, isolated: bool = False, env: dict | None = None) -> NodeProcess:
        if isolated:
            node = NodeProcess.join(
                name, self.tmp, *FLAGS, *self.extra, *args, host=self.link.inner_ip, prefix=self.link.prefix, env=env
            )
        else:
            node = NodeProcess.join(name, self.tmp, *FLAGS, *self.extra, *args, host=self.host, env=env)
        self.nodes.append(node)
        return node

    def restart(self, victim: NodeProcess) -> NodeProcess:
        self.nodes.remove(victim)
        self.gone.append(victim)  # its log is checked with the others'
        Path(str(victim.state_dir) + ".before-restart.log").write_text(victim.output)
        return self.start(victim.name, "--peer", self.address)

    def wait_round(self, node: NodeProcess, step: int, timeout: float = 120) -> None:
        """Until the node has finished round `step` or a later one (a resync may skip rounds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if finished_round(node) >= step:
                return
            if node.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{node.name} did not finish round {step}; output:\n{node.output}")

    def wait_until_rounds(self, node: NodeProcess, count: int, timeout: float = 120) -> None:
        """Until this process of the node has ended `count` rounds of its own."""
        assert ended_rounds(node, count, timeout), f"{node.name} ended no {count} round(s); output:\n{node.output}"

    def settle(self, victim: NodeProcess, step: int) -> None:
        """The victim finished round `step` (caught up and trained on), then everyone mixed fully a few times."""
        self.wait_round(victim, step)
        newest = max(s["outer_step"] for s in (_status(n) for n in self.nodes) if s)
        for node in self.nodes:
            self.wait_round(node, newest + 3)

    def strike_at_phase(
        self, victim: NodeProcess, step: int, phase: str, action: Callable[[], None] | int, timeout: float = 120
    ) -> str:
        """Run `action` (or send that signal) when the victim is in `phase` of outer step `step`; returns what fired."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = _status(victim)
            if status and status.get("outer_step") == step and status.get("phase") == phase:
                if callable(action):
                    action()
                else:
                    victim.proc.send_signal(action)
                return f"{phase} of step {step}"
            if status and status.get("outer_step", 0) > step:
                step = status["outer_step"]  # missed it: take the next round's
            time.sleep(0.003)
        raise AssertionError(f"{victim.name} never reached {phase} of step {step}")

    def strike_during_checkpoint_write(self, victim: NodeProcess, sig: int, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            temps = list(victim.state_dir.glob(".ckpt-*.tmp-*")) + list(victim.state_dir.glob(".local-*.tmp-*"))
            if temps:
                victim.proc.send_signal(sig)
                return f"write of {temps[0].name}"
            time.sleep(0.0005)
        raise AssertionError(f"{victim.name} wrote no checkpoint in {timeout}s")

    def kill(self, victim: NodeProcess) -> None:
        victim.kill()
        self.nodes.remove(victim)
        self.gone.append(victim)

    def stop_all(self, timeout: float = 60) -> None:
        for node in self.nodes:
            node.stop()
        for node in self.nodes:
            node.wait(timeout)

    def kill_all(self) -> None:
        for node in self.gone + self.nodes:  # a restarted node's log last: it shares its victim's name
            node.kill()
            Path(str(node.state_dir) + ".log").write_text(node.output)  # for post-mortems
        if self.link is not None:
            self.link.close()


def finished_round(node: NodeProcess) -> int:
    """The newest round this process ended (from its history.jsonl), -1 before its first."""
    return max((r["round"] for r in node.own_rounds), default=-1)


def groups(entry: dict) -> str:
    """A round's groups as the round log line writes them: size/expected per hop ("4/4")."""
    return " ".join(f"{size}/{expected}" for size, expected in entry["groups"]) or "-"


def round_groups(node: NodeProcess, first: int = 0) -> list[str]:
    """The groups of each round this process ended, from round `first` on."""
    return [groups(r) for r in node.own_rounds if r["round"] >= first]


def round_durations(node: NodeProcess) -> list[float]:
    """Seconds between the ends of consecutive rounds of this process."""
    return [b["time"] - a["time"] for a, b in itertools.pairwise(node.own_rounds)]


def check(swarm: Swarm, trial: Trial, dims: int = 1) -> Trial:
    """The promises, over every node still running at the end (and the files of all)."""
    bound = 20 + dims * (WINDOW + TIMEOUT) + 2  # inner steps on a busy 2-core box, plus the deadlines
    for node in swarm.nodes:
        if node.name in trial.victims:
            continue
        durations = round_durations(node)
        if durations:
            trial.worst_round_s = max(trial.worst_round_s, max(durations))
    if trial.worst_round_s > bound:
        trial.notes.append(f"a round took {trial.worst_round_s:.0f}s > {bound:.0f}s")
    for node in swarm.nodes + swarm.gone:
        for step, _ in list_checkpoints(node.state_dir):
            try:
                values = theta(node.state_dir, step)
            except Exception as e:  # noqa: BLE001  (a torn file under a final name would land here)
                trial.notes.append(f"{node.name}: checkpoint {step} unreadable ({e})")
                continue
            if not bool(torch.isfinite(values).all()):
                trial.notes.append(f"{node.name}: non-finite θ_g at step {step}")
    common = set.intersection(*({s for s, _ in list_checkpoints(n.state_dir)} for n in swarm.nodes))
    if len(common) >= 2:
        last, before = max(common), max(common - {max(common)})
        reference = theta(swarm.nodes[0].state_dir, last)
        update = float((reference - theta(swarm.nodes[0].state_dir, before)).norm())
        spread = max(float((theta(n.state_dir, last) - reference).norm()) for n in swarm.nodes)
        if update > 0 and spread / update > 0.05:
            trial.notes.append(f"θ_g spread {spread / update:.3f} of an update at step {last}")
    else:
        trial.notes.append("survivors share no two checkpoint steps")
    for node in swarm.nodes:
        # its whole history.jsonl: a restarted node's rounds before the restart included
        evals = [r["eval_loss"] for r in node.rounds if r["eval_loss"] is not None]
        if len(evals) >= 2 and not evals[-1] < evals[0]:
            trial.notes.append(f"{node.name}: eval loss did not fall ({evals[0]:.3f} -> {evals[-1]:.3f})")
        trained = [r["loss"] for r in node.rounds if r["inner_steps"] > 0]
        if any(loss is None or not math.isfinite(loss) for loss in trained):
            trial.notes.append(f"{node.name}: a non-finite training loss")
    _no_tracebacks(swarm, trial)
    trial.passed = not trial.notes
    return trial


# ---- scenarios: each runs one trial in `tmp` and returns it, checked ----------------------


def run_trial(
    tmp: Path,
    scenario: str,
    nodes: int,
    inject: Callable[[Swarm, Trial], None],
    isolate_last: bool = False,
    last_env: dict | None = None,
) -> Trial:
    """Start a swarm, let `inject` strike and wait out its aftermath, stop cleanly, check."""
    trial = Trial(scenario)
    swarm = Swarm(tmp, nodes, isolate_last=isolate_last, last_env=last_env)
    try:
        inject(swarm, trial)
        swarm.stop_all()
        return check(swarm, trial)
    finally:
        swarm.kill_all()


def kill9_at(phase: str) -> Callable[[Path], Trial]:
    def inject(swarm: Swarm, trial: Trial) -> None:
        victim = swarm.nodes[-1]
        swarm.wait_round(victim, 1)
        trial.fired = swarm.strike_at_phase(victim, 2, phase, signal.SIGKILL)
        swarm.kill(victim)
        for node in swarm.nodes:
            swarm.wait_round(node, 5)

    return lambda tmp: run_trial(tmp, f"kill -9 during {phase}", 4, inject)


def kill9_at_failpoint(point: str) -> Callable[[Path], Trial]:
    """The victim SIGKILLs itself at a failpoint inside the data plane (see peers/failpoints.py):
    mid-send (some reducers have its chunks, others not) or mid-reduce (it owes results)."""

    def inject(swarm: Swarm, trial: Trial) -> None:
        victim = swarm.nodes[-1]
        reached = victim.wait_for_line(rf"failpoint {point}@(\d+) reached", timeout=120)
        victim.proc.wait()
        trial.fired = f"{point} in round {reached.group(1)} (failpoint)"
        swarm.kill(victim)
        for node in swarm.nodes:
            swarm.wait_round(node, 5)

    return lambda tmp: run_trial(tmp, f"kill -9 while {point}", 4, inject, last_env={FAILPOINT_ENV: f"{point}@2"})


CUT_S = WINDOW + TIMEOUT + 4  # past the victim's membership TTL: the others must drop it, then take it back
SLOW_MBIT = 8


def _network_cut(swarm: Swarm, trial: Trial) -> None:
    """The victim's only link goes dark mid-all-reduce (packets vanish, no RST), then comes back."""
    victim, link = swarm.nodes[-1], swarm.link
    swarm.wait_round(victim, 1)
    trial.fired = "link cut in " + swarm.strike_at_phase(victim, 2, "allreduce", link.cut)
    trial.victims.add(victim.name)
    time.sleep(CUT_S)
    link.restore()
    trial.fired += f", restored {CUT_S:.0f}s later at its round {finished_round(victim)}"
    swarm.settle(victim, finished_round(victim) + 2)


def _slow_link(swarm: Swarm, trial: Trial) -> None:
    """The victim's link drops to SLOW_MBIT in both directions for four rounds; its rounds count."""
    victim, link = swarm.nodes[-1], swarm.link
    swarm.wait_round(victim, 1)
    fired = swarm.strike_at_phase(victim, 2, "matchmaking", lambda: link.throttle(SLOW_MBIT))
    first = finished_round(victim) + 1
    swarm.wait_round(victim, first + 3)
    link.unthrottle()
    trial.fired = f"{SLOW_MBIT} Mbit/s from {fired}; its groups while slow: {' '.join(round_groups(victim, first)[:4])}"
    swarm.settle(victim, finished_round(victim) + 1)


def _checkpoint_write_then_restart(swarm: Swarm, trial: Trial) -> None:
    """Struck while a temp file of its checkpoint is being written; it restarts from its state dir."""
    victim = swarm.nodes[-1]
    swarm.wait_round(victim, 1)
    trial.fired = swarm.strike_during_checkpoint_write(victim, signal.SIGKILL)
    victim.proc.wait()
    back = swarm.restart(victim)
    swarm.wait_until_rounds(back, 1)
    resumed = next((a["step"] for a in back.own_rounds[0]["synced"] if a["source"] == "resumed"), None)
    assert resumed is not None, f"{back.name} did not resume from its state dir: {back.own_rounds[0]}"
    trial.fired += f"; resumed at step {resumed}"
    swarm.settle(back, resumed + 1)


def _sigstop_past_the_timeout(swarm: Swarm, trial: Trial) -> None:
    victim = swarm.nodes[-1]
    swarm.wait_round(victim, 1)
    trial.fired = swarm.strike_at_phase(victim, 2, "matchmaking", signal.SIGSTOP)
    trial.victims.add(victim.name)
    time.sleep(WINDOW + TIMEOUT + 2)
    victim.proc.send_signal(signal.SIGCONT)
    swarm.settle(victim, 3)


def _late_joiner(swarm: Swarm, trial: Trial) -> None:
    swarm.wait_round(swarm.nodes[0], 2)
    joiner = swarm.start("late", "--peer", swarm.address)
    synced = joiner.in_step_at(timeout=60)
    trial.fired = f"joined and synced at step {synced}"
    for node in swarm.nodes:
        swarm.wait_round(node, synced + 3)


def _slow_peer(swarm: Swarm, trial: Trial) -> None:
    """The last node's inner steps take 4x as long all run (DTNODE_TEST_SLOW_INNER=4). With
    rounds paced by the swarm it takes fewer steps, nobody waits for it, and it is in every
    group: from round 1 on each of its rounds must show the whole swarm in its group, and its
    tokens must stay below every other node's."""
    slow = swarm.nodes[-1]
    for node in swarm.nodes:
        swarm.wait_round(node, 6)
    size = len(swarm.nodes)
    slow_groups = round_groups(slow, 1)
    trial.fired = f"4x slower inner steps; its groups: {' '.join(slow_groups)}"
    if any(g != f"{size}/{size}" for g in slow_groups):
        trial.notes.append(f"the slow node was not in a full group every round: {slow_groups}")

    def tokens(node: NodeProcess) -> int:
        return sum(r["tokens"] for r in node.own_rounds if r["round"] >= 1)

    slow_tokens, others = tokens(slow), [tokens(n) for n in swarm.nodes[:-1]]
    trial.fired += f"; tokens from round 1: slow {slow_tokens}, others {others}"
    if not slow_tokens < min(others):
        trial.notes.append(f"the slow node processed {slow_tokens} tokens, not fewer than the others {others}")


def _wait_known_peers(node: NodeProcess, count: int, timeout: float = 60) -> None:
    """Until the node has saved the addresses of `count` peers (every few seconds, see daemon/node.py)."""
    path = node.state_dir / "known-peers.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(json.loads(path.read_text())["peers"]) >= count:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{node.name} saved no {count} known peers in {timeout:.0f}s")


def _kill_and_restart(swarm: Swarm, trial: Trial, victim: NodeProcess, peer: str) -> NodeProcess:
    """kill -9 `victim` mid-round and restart it on its state dir with `--peer peer`; it must be
    in a group of the whole swarm within its first two rounds after the restart."""
    swarm.wait_round(victim, finished_round(victim) + 1)
    _wait_known_peers(victim, len(swarm.nodes) - 1)
    victim.kill()
    swarm.nodes.remove(victim)
    Path(str(victim.state_dir) + f".before-restart-{len(swarm.gone)}.log").write_text(victim.output)
    swarm.gone.append(victim)
    back = swarm.start(victim.name, "--peer", peer)
    size = len(swarm.nodes)
    ended_rounds(back, 2, timeout=180)
    early = round_groups(back)[:2]
    if f"{size}/{size}" not in early:
        trial.notes.append(f"{victim.name} restarted was in no full group within two rounds: {early}")
    return back


def ended_rounds(node: NodeProcess, count: int, timeout: float) -> bool:
    """Whether this process of the node ends `count` rounds of its own within `timeout` seconds
    (False as soon as it exits short of them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and node.proc.poll() is None and len(node.own_rounds) < count:
        time.sleep(0.1)
    return len(node.own_rounds) >= count


def _no_tracebacks(swarm: Swarm, trial: Trial) -> None:
    for node in swarm.nodes + swarm.gone:
        if "Traceback" in node.output:
            trial.notes.append(f"{node.name}: a traceback in its log")


def _restart_the_first_node(swarm: Swarm, trial: Trial) -> None:
    """The node everyone joined through is killed and restarted with --peer naming its own
    old address (its DHT port is reused, so that address is its new one too)."""
    first = swarm.nodes[0]
    swarm.wait_round(first, 1)
    back = _kill_and_restart(swarm, trial, first, swarm.address)
    if back.join_address != swarm.address:
        trial.notes.append(f"the first node came back at {back.join_address}, not {swarm.address}")
    trial.fired = (
        f"killed the first node at its round {finished_round(first)}; back at round "
        f"{min((r['round'] for r in back.own_rounds), default=-1)}: {' '.join(round_groups(back)[:2])}"
    )
    for node in swarm.nodes:
        swarm.wait_round(node, finished_round(back) + 1)


def _restart_each_node(swarm: Swarm, trial: Trial) -> None:
    """Each of the nodes in turn: kill -9 mid-round, restart on its state dir with the same
    --peer as before (the first node's address, its own for the first node)."""
    fired = []
    for name in [n.name for n in swarm.nodes]:
        victim = next(n for n in swarm.nodes if n.name == name)
        back = _kill_and_restart(swarm, trial, victim, swarm.address)
        fired.append(f"{name}: {' '.join(round_groups(back)[:2])}")
    trial.fired = "; ".join(fired)
    newest = max(finished_round(n) for n in swarm.nodes)
    for node in swarm.nodes:
        swarm.wait_round(node, newest + 1)


SCENARIOS = {
    "kill9-matchmaking": kill9_at("matchmaking"),
    "kill9-allreduce": kill9_at("allreduce"),
    "kill9-sending": kill9_at_failpoint("sending"),
    "kill9-reducing": kill9_at_failpoint("reducing"),
    "kill9-checkpoint-write": lambda tmp: run_trial(
        tmp, "kill -9 during a checkpoint write, restart", 3, _checkpoint_write_then_restart
    ),
    "sigstop": lambda tmp: run_trial(tmp, "SIGSTOP past the timeout, SIGCONT", 4, _sigstop_past_the_timeout),
    "late-joiner": lambda tmp: run_trial(tmp, "late joiner during a round", 3, _late_joiner),
    "network-cut": lambda tmp: run_trial(
        tmp, "network cut mid-all-reduce, restored", 4, _network_cut, isolate_last=True
    ),
    "slow-link": lambda tmp: run_trial(
        tmp, f"slow link ({SLOW_MBIT} Mbit/s) for 4 rounds", 4, _slow_link, isolate_last=True
    ),
    "slow-peer": lambda tmp: run_trial(
        tmp, "one peer 4x slower all run", 4, _slow_peer, last_env={"DTNODE_TEST_SLOW_INNER": "4"}
    ),
    "restart-first": lambda tmp: run_trial(
        tmp, "first node killed, back with its own --peer", 4, _restart_the_first_node
    ),
    "restart-each": lambda tmp: run_trial(tmp, "each node killed and restarted in turn", 4, _restart_each_node),
}
NETWORK_SCENARIOS = {"network-cut", "slow-link"}  # need root and iproute2 (chaos/netns.py)
