"""Whole nodes as separate processes: DHT, gRPC, HTTP and training, all real, on loopback."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from nodes import FAST, NodeProcess, dtnode_status
from nodes import theta as checkpoint_theta

from dtnode.daemon.checkpoints.file_format import Layout, checkpoint_path, read_checkpoint
from dtnode.daemon.training.schedule import LearningRateSchedule
from dtnode.daemon.workload.model import build_model, config_hash
from dtnode.ops.flat import FlatParameters, sha256_of

STATUS_FIELDS = {
    "peer_id",
    "run_id",
    "state",
    "outer_step",
    "inner_step",
    "loss",
    "tokens_per_s",
    "uptime_s",
    "params_sha256",
    "http_url",
    "last_round",
}
LAST_ROUND_FIELDS = {"group_size", "included_peers", "duration_s", "allreduce_s", "bytes_sent", "bytes_received"}
RECORD_FIELDS = {
    "peer_id",
    "grpc_addr",
    "http_addr",
    "outer_step",
    "checkpoint_step",
    "checkpoint_sha256",
    "tokens_per_s",
    "device",
    "client_mode",
    "model_hash",
    "version",
}


def theta(node: NodeProcess, step: int) -> torch.Tensor:
    return checkpoint_theta(node.state_dir, step)


def test_three_joined_processes_train_in_consensus(tmp_path, cleanup):
    first = NodeProcess.join("a", tmp_path, *FAST, "--min-peers", "3", "--run-id", "swarm-test")
    cleanup.append(first)
    join_line = first.wait_for_line(r"(dtnode join --peer \S+.*)").group(1)
    assert "--run-id swarm-test" in join_line  # the printed command is complete
    address = first.join_address
    others = [
        NodeProcess.join(
            name, tmp_path, *FAST, "--min-peers", "3", "--run-id", "swarm-test", "--peer", address, "--max-rounds", "4"
        )
        for name in ("b", "c")
    ]
    cleanup.extend(others)
    for node in others:
        assert node.wait(120) == 0, node.output
    # The first node keeps training alone; its sidecar shows the documented fields.
    status = first.get("/status")
    assert STATUS_FIELDS <= set(status) and LAST_ROUND_FIELDS <= set(status["last_round"])
    assert (
        status["run_id"] == "swarm-test" and status["outer_step"] >= 4 and status["state"] in ("training", "averaging")
    )
    peers = first.get("/peers")
    assert peers and all(RECORD_FIELDS <= set(p) for p in peers)
    own = next(p for p in peers if p["peer_id"] == status["peer_id"])
    assert own["grid_dims"] == 1  # three peers: one group (peers take the grid their peers' records say)
    # each checkpoint it served once, from memory and from its file alike: the newest steps it served
    assert len(set(own["served"])) == len(own["served"]) >= 2, own["served"]
    assert own["served"][-1] == f"{own['checkpoint_step']}:{own['checkpoint_sha256']}", own
    table = dtnode_status(first.http_url)
    assert table.returncode == 0 and status["peer_id"] in table.stdout and "swarm:" in table.stdout
    first.stop(signal.SIGTERM)
    assert first.wait(30) == 0, first.output
    assert re.search(r"stopped at outer step \d+; \d+\.\d% of the time .* was spent in inner steps", first.output)

    for node in (first, *others):
        rounds = node.rounds[:4]
        assert [r["round"] for r in rounds] == [0, 1, 2, 3], node.output
        assert all(r["groups"][0][0] == 3 for r in rounds), node.output
        # of each round's matchmaking, the wait for the group's last registrant
        assert all(0 <= r["matchmaking_waited_s"] <= r["phases_s"]["matchmaking"] + 0.01 for r in rounds), rounds
    assert any(r["matchmaking_waited_s"] > 0 for node in (first, *others) for r in node.rounds[:4])
    for step in range(1, 5):
        reference = theta(first, step)
        for node in others:
            other = theta(node, step)
            # members apply the same averaged bytes: θ_g agrees far within the int8 error
            assert float((other - reference).norm() / reference.norm()) <= 1e-2
    losses = [r["eval_loss"] for r in others[0].rounds]
    assert losses[-1] < losses[0]


ROUND_S = 6.0  # --round-seconds of the time-paced swarm below
LATE_S = 3  # how much later than the others two of its nodes enter round 2


def test_time_paced_peers_end_a_round_together_when_some_entered_it_late(tmp_path, cleanup):
    """--round-seconds counts from the swarm's median start of the round (rounds/pacer.py): two
    of four nodes enter round 2 LATE_S seconds after the others (a failpoint holds them after
    round 1's outer step, as a slow average would), so the median start is half that later. The
    punctual pair trains on through what was their wait at hop 0, the late pair ends with them:
    each pair's inner seconds of round 2 lie on its side of the budget, and all four average in
    one full group."""
    args = [
        *FAST,
        "--min-peers",
        "4",
        "--max-rounds",
        "3",
        "--round-tokens",
        str(10**12),
        "--round-seconds",
        f"{ROUND_S:g}",
    ]
    late = {"DTNODE_TEST_FAILPOINT": f"outer-phase@1:{LATE_S}"}
    first = NodeProcess.join("p0", tmp_path, *args)
    cleanup.append(first)
    nodes = [first]
    for name, env in (("p1", None), ("late0", late), ("late1", late)):
        nodes.append(NodeProcess.join(name, tmp_path, *args, "--peer", first.join_address, env=env))
        cleanup.append(nodes[-1])
    for node in nodes:
        assert node.wait(180) == 0, node.output
        assert "Traceback" not in node.output, node.output
    story = {node.name: [(r["round"], r["phases_s"], r["groups"]) for r in node.rounds] for node in nodes}
    second = {node.name: next(r for r in node.rounds if r["round"] == 2) for node in nodes}
    inner = {name: entry["phases_s"]["inner"] for name, entry in second.items()}
    # the median start is LATE_S / 2 after the punctual pair's: they train about that much longer
    # than the budget and the late pair that much less (half of it asserted: a loaded host's spread)
    assert all(inner[name] >= ROUND_S + LATE_S / 4 for name in ("p0", "p1")), story
    assert all(inner[name] <= ROUND_S - LATE_S / 4 for name in ("late0", "late1")), story
    assert all(entry["outcome"] == "full" and entry["groups"][0][0] == 4 for entry in second.values()), story
    assert len({entry["params_sha256"] for entry in second.values()}) == 1, story


def test_local_swarm_trains_and_stops_on_ctrl_c(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "dtnode",
            "local",
            "--nodes",
            "3",
            "--base-dir",
            str(tmp_path),
            *FAST,
            "--log-format",
            "json",
        ],  # the others join through node0's address in a JSON line
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + 120
    try:
        for line in proc.stdout:
            lines.append(line)
            done = {
                n
                for n in ("node0", "node1", "node2")
                if any(l.lstrip().startswith(n) and "round 3 |" in l for l in lines)
            }
            if len(done) == 3 or time.monotonic() > deadline:
                break
        # the host's cores are shared among the nodes, not each node's torch taking all of them
        nodes = [p.cmdline() for p in psutil.Process(proc.pid).children() if "join" in p.cmdline()]
        threads = str(max(1, (os.cpu_count() or 1) // 3))
        assert len(nodes) == 3 and all(c[c.index("--threads-per-rank") + 1] == threads for c in nodes), nodes
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        lines.append(rest)
    finally:
        proc.kill()
    output = "".join(lines)
    assert proc.returncode == 0, output
    assert "Traceback" not in output and "failed" not in output, output
    for n in ("node0", "node1", "node2"):
        mine = [l for l in output.splitlines() if l.lstrip().startswith(n)]
        rounds = [l for l in mine if re.search(r"round \d+ \| groups 3/3", l)]
        assert len(rounds) >= 4, output
        losses = [float(m.group(1)) for line in rounds if (m := re.search(r"\| loss (\d+\.\d+)", line))]
        assert losses[-1] < losses[0]
        assert any("stopped at outer step" in l for l in mine), output


@pytest.mark.long_swarms  # 26 s; out of the default suite's 10 minutes
def test_late_joiner_downloads_state_and_trains_in_step(tmp_path, cleanup):
    a = NodeProcess.join("a", tmp_path, *FAST, "--min-peers", "2")
    cleanup.append(a)
    b = NodeProcess.join("b", tmp_path, *FAST, "--min-peers", "2", "--peer", a.join_address)
    cleanup.append(b)
    b.wait_for_round(lambda r: r["round"] >= 2 and r["groups"][0][0] == 2, timeout=90)
    c = NodeProcess.join("c", tmp_path, *FAST, "--peer", a.join_address, "--max-own-rounds", "3")
    cleanup.append(c)
    synced = c.in_step_at(timeout=60)
    assert synced >= 2
    assert c.wait(90) == 0, c.output
    # the joiner's state equals the donor's checkpoint, bit for bit
    assert torch.equal(theta(c, synced), theta(a, synced))
    # and it then averaged with the others
    sizes = [r["groups"][0][0] for r in c.rounds if r["groups"]]
    assert 3 in sizes, c.output
    for node in (a, b):
        node.stop()
        assert node.wait(30) == 0, node.output


def test_restart_resumes_from_its_checkpoint(tmp_path):
    schedule = ["--total-steps", "100", "--warmup-steps", "5", "--lr-schedule", "cosine", "--pacing", "fixed"]
    first = NodeProcess.join("solo", tmp_path, *FAST, *schedule, "--max-rounds", "3", "--eval-every", "2")
    assert first.wait(60) == 0, first.output
    # --eval-every 2: only θ_g of step 2 is evaluated; a later round line shows that loss and its step
    assert re.search(r"round 0 \|.*\| eval - \(floor", first.output), first.output
    evaluated = re.search(r"round 1 \|.*\| eval (\d+\.\d+) \(floor", first.output).group(1)
    assert re.search(rf"round 2 \|.*\| eval {evaluated}@2 \(floor", first.output), first.output
    history = [json.loads(line) for line in (first.state_dir / "history.jsonl").read_text().splitlines()]
    assert [h["eval_loss"] is not None for h in history] == [False, True, False]
    assert all(h["phases_s"]["eval"] > 0 for h in history if h["eval_loss"] is not None)
    # a kill -9 mid-write of step 4 would leave a torn file; here also under the final name
    good = checkpoint_path(first.state_dir, 3).read_bytes()
    checkpoint_path(first.state_dir, 4).write_bytes(good[: len(good) // 2])
    again = NodeProcess.join("solo", tmp_path, *FAST, *schedule, "--max-own-rounds", "1")
    assert again.wait(60) == 0, again.output
    model, description = build_model("tiny", seed=0)
    flat = FlatParameters(model.named_parameters())
    saved = read_checkpoint(
        checkpoint_path(first.state_dir, 3),
        Layout(tuple(flat.names), tuple(flat.shapes)),
        "dtnode-demo",
        config_hash(description),
    )
    # the history says where each round's θ_g began: the restart's round from the resumed file
    # of step 3, the torn file of step 4 skipped, its parameters bit-identical to the saved ones
    resumed = {"source": "resumed", "step": 3, "params_sha256": sha256_of(saved.theta_g)}
    assert [(r["round"], r["groups"][0][0]) for r in again.rounds[3:]] == [(3, 1)], again.output
    assert [r["synced"] for r in again.rounds] == [[], [], [], [resumed]], again.rounds
    # the learning-rate schedule goes on from the swarm's position (outer step 3 x H=15), with
    # the restored AdamW moments needing no second warmup: the round's last step is position 59
    lr = LearningRateSchedule(1e-3, warmup_steps=5, total_steps=100)
    assert (history[2]["inner_steps"], history[2]["lr"]) == (15, pytest.approx(lr(44))), history[2]
    assert (again.rounds[3]["inner_steps"], again.rounds[3]["lr"]) == (15, pytest.approx(lr(59))), again.rounds[3]
