"""A swarm of whole node processes with --compression sparse: real DHT, gRPC and checkpoints."""

import re

import pytest
import torch
from nodes import FAST, NodeProcess, run_swarm, wait_until, written
from nodes import theta as checkpoint_theta
from safetensors.torch import load_file

from dtnode.daemon.checkpoints.file_format import FEEDBACK, checkpoint_path, local_state_path

SPARSE = ["--compression", "sparse", "--sparse-top-k", "32", "--run-id", "sparse-swarm"]


@pytest.mark.long_swarms  # about 60 s: outside the default suite's 10 minutes, run by .ci/run
def test_a_sparse_swarm_agrees_on_theta_g_and_a_restart_keeps_what_it_had_not_sent(tmp_path):
    args = [*FAST, *SPARSE, "--min-peers", "3", "--max-rounds", "5"]
    seen: dict = {}

    def others(address: str) -> list[NodeProcess]:
        joined = [NodeProcess.join(name, tmp_path, *args, "--peer", address) for name in ("b", "c")]
        joined[0].wait_for_round(lambda r: r["round"] >= 1, timeout=180)
        seen["status"], seen["metrics"] = joined[0].get("/status"), joined[0].get_text("/metrics")
        return joined

    nodes = run_swarm(NodeProcess.join("a", tmp_path, *args), others, timeout=300)
    # /status and /metrics say how Δ travels
    last = seen["status"]["last_round"]
    assert last["compression"] == "sparse" and last["density"] == 32 / 4096, last
    assert 0 < last["bytes_per_param"] < 0.5 and last["feedback_norm"] > 0, last
    assert 'dtnode_wire_bytes_per_param{compression="sparse"}' in seen["metrics"]
    assert "dtnode_wire_density 0.0078125" in seen["metrics"]
    assert "dtnode_error_feedback_norm" in seen["metrics"] and "dtnode_refused_streams_total" in seen["metrics"]
    for node in nodes:
        assert "Traceback" not in node.output, node.output
        rounds = node.rounds[:5]
        assert [r["round"] for r in rounds] == [0, 1, 2, 3, 4], node.output
        assert all(r["groups"] == [[3, 3]] for r in rounds), node.output
        # the round line says how Δ travelled: 32 of 4096 values kept, and the buffer's norm
        assert re.search(r"\| sparse [\d.e-]+ B/param, 0\.78% kept, feedback [\d.e+-]+ \|", node.output), node.output
    for step in range(1, 6):  # every member applies the same bytes: θ_g is bit-identical
        reference = checkpoint_theta(nodes[0].state_dir, step)
        for node in nodes[1:]:
            assert torch.equal(checkpoint_theta(node.state_dir, step), reference), (node.name, step)
    assert len({r["params_sha256"] for node in nodes for r in node.rounds[4:5]}) == 1

    # what a node had not sent yet is in its own checkpoint, and a restart takes it back
    owed = load_file(str(written(local_state_path(nodes[0].state_dir, 5))))[FEEDBACK]
    assert float(owed.norm()) > 0
    again = NodeProcess.join("a", tmp_path, *FAST, *SPARSE, "--min-peers", "1")

    def restored() -> float | None:
        """The gauge while the node trains its first round from step 5: the buffer it read back."""
        before = again.status()
        if not before or before["state"] not in ("training", "averaging"):
            return None
        norm = again.metric("dtnode_error_feedback_norm")
        after = again.status()
        return norm if after and before["outer_step"] == after["outer_step"] == 5 else None

    try:
        norm = wait_until(restored, 120, lambda: f"resumed at step 5; output:\n{again.output[-4000:]}")
    finally:
        again.kill()
    assert norm == pytest.approx(float(owed.norm()), rel=1e-5)


@pytest.mark.long_swarms  # about 30 s
def test_sparse_with_overlap_lands_the_same_bytes_on_every_member(tmp_path):
    """--overlap sends a round's sparse Δ while the next round trains; the average lands between
    two inner steps, and both members still hold the same θ_g at every step."""
    args = [*FAST, *SPARSE, "--overlap", "--min-peers", "2", "--max-rounds", "4"]
    nodes = run_swarm(
        NodeProcess.join("a", tmp_path, *args),
        lambda address: [NodeProcess.join("b", tmp_path, *args, "--peer", address)],
        timeout=300,
    )
    for node in nodes:
        assert "Traceback" not in node.output, node.output
        assert all(r["groups"] in ([[2, 2]], []) for r in node.rounds[:4]), node.output
    for step in range(1, 5):
        assert torch.equal(checkpoint_theta(nodes[0].state_dir, step), checkpoint_theta(nodes[1].state_dir, step))


@pytest.mark.long_swarms  # about 20 s: outside the default suite's 10 minutes, run by .ci/run
def test_a_theta_g_that_differs_by_one_bit_is_found_by_its_hash_and_re_synced(tmp_path):
    """Nothing tells a member that its θ_g came out in other bits than its peers' (a part that
    failed in another group, a restart from an older checkpoint): its round was clean, so it
    asks for nothing, and sparse mode has no scheduled re-sync. Its group sees two hashes in the
    registrations and re-syncs anyway, so the swarm holds one θ_g again a round later."""
    args = [*FAST, *SPARSE, "--min-peers", "2", "--max-rounds", "4"]
    nodes = run_swarm(
        NodeProcess.join("a", tmp_path, *args),
        lambda address: [
            NodeProcess.join("b", tmp_path, *args, "--peer", address, env={"DTNODE_TEST_FAILPOINT": "diverge-theta@1"})
        ],
        timeout=300,
    )
    a, b = nodes
    assert "failpoint diverge-theta@1 reached" in b.output, b.output
    hashes = [[r["params_sha256"] for r in node.rounds[:4]] for node in nodes]
    assert hashes[0][0] == hashes[1][0] and hashes[0][1] != hashes[1][1], hashes  # the fault, after round 1
    assert hashes[0][2:] == hashes[1][2:], hashes  # round 2's group re-synced: one θ_g again
    for node in nodes:
        assert "Traceback" not in node.output, node.output
        assert re.search(r"round 2 hop 0: the group's members hold different θ_g \(hashes \w+, \w+\)", node.output)
    assert torch.equal(checkpoint_theta(a.state_dir, 4), checkpoint_theta(b.state_dir, 4))


@pytest.mark.long_swarms  # about 40 s
def test_a_joiner_of_a_sparse_swarm_downloads_theta_g_alone_and_averages_in_step(tmp_path):
    """Without outer momentum (sparse's default) a checkpoint is θ_g alone: a joiner downloads
    4 bytes per parameter, not 8 (the tiny model's file was 1.0 MB, now 0.5), and the swarm,
    joiner included, ends on one θ_g."""
    # rounds of a second or two (H=150), so that the joiner comes up while the swarm trains
    args = [*FAST, *SPARSE, "--inner-steps", "150", "--min-peers", "2", "--max-rounds", "8"]

    def others(address: str) -> list[NodeProcess]:
        b = NodeProcess.join("b", tmp_path, *args, "--peer", address)
        b.wait_for_round(lambda r: r["round"] >= 1, timeout=180)
        return [b, NodeProcess.join("c", tmp_path, *args, "--peer", address)]

    nodes = run_swarm(NodeProcess.join("a", tmp_path, *args), others, timeout=300)
    c = nodes[2]
    downloads = [a for r in c.rounds for a in r["synced"] if a["source"] == "downloaded"]
    assert downloads and all(a["bytes"] <= 0.5e6 for a in downloads), c.rounds
    assert any(r["groups"][0][0] == 3 for r in c.rounds), c.output  # it averaged with both
    for node in nodes:
        assert "Traceback" not in node.output, node.output
        assert "outer_momentum" not in load_file(str(written(checkpoint_path(node.state_dir, 8))))
    assert torch.equal(checkpoint_theta(nodes[0].state_dir, 8), checkpoint_theta(c.state_dir, 8))
    assert torch.equal(checkpoint_theta(nodes[1].state_dir, 8), checkpoint_theta(c.state_dir, 8))
