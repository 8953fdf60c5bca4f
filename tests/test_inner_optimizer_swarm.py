"""A swarm that trains with `--inner-optimizer muon` (issue 59; the default) or adamw, as real
processes on loopback: peers that take the optimizer from the first node's sidecar, θ_g bit for bit
alike after every round, and a late joiner that takes the optimizer with the recipe and saves its
state."""

from __future__ import annotations

import pytest
import torch
from nodes import FAST_DEFAULT_OPTIMIZER, NodeProcess, wait_until
from nodes import theta as checkpoint_theta
from safetensors import safe_open

from dtnode.daemon.checkpoints.file_format import list_checkpoints, local_state_path

ROUNDS = 5


def _inner_optimizer_saved(node: NodeProcess) -> str:
    """The optimizer named in the node's newest local state file."""
    step = list_checkpoints(node.state_dir)[0][0]
    with safe_open(str(local_state_path(node.state_dir, step)), "pt") as f:
        return (f.metadata() or {})["inner_optimizer"]


@pytest.mark.long_swarms  # about 60 s each on 2 cores: outside the default suite's 10 minutes
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_a_swarm_agrees_on_theta_g_bit_for_bit_and_a_joiner_takes_its_optimizer(tmp_path, cleanup, optimizer):
    a = NodeProcess.join("a", tmp_path, *FAST_DEFAULT_OPTIMIZER, "--inner-optimizer", optimizer, "--min-peers", "3")
    cleanup.append(a)
    others = [
        NodeProcess.join(name, tmp_path, *FAST_DEFAULT_OPTIMIZER, "--min-peers", "3", "--peer", a.http_url)
        for name in "bc"
    ]
    cleanup.extend(others)
    swarm = [a, *others]
    wait_until(lambda: all(len(n.rounds) >= ROUNDS for n in swarm), 240, f"{ROUNDS} rounds on every node")
    for node in swarm:
        assert node.status()["recipe"]["inner_optimizer"] == optimizer, node.output
        assert [r["groups"] for r in node.rounds[:ROUNDS]] == [[[3, 3]]] * ROUNDS, node.output
    for step in range(1, ROUNDS + 1):
        reference = checkpoint_theta(a.state_dir, step)
        for node in others:
            assert torch.equal(checkpoint_theta(node.state_dir, step), reference), (node.name, step)

    d = NodeProcess.join("d", tmp_path, *FAST_DEFAULT_OPTIMIZER, "--peer", a.http_url, "--max-own-rounds", "2")
    cleanup.append(d)
    synced = d.in_step_at(timeout=90)
    assert d.wait(120) == 0, d.output
    assert torch.equal(checkpoint_theta(d.state_dir, synced), checkpoint_theta(a.state_dir, synced))
    assert any(r["groups"] and r["groups"][0][0] == 4 for r in d.rounds), d.output
    assert _inner_optimizer_saved(d) == optimizer
    for node in swarm:
        node.stop()
        assert node.wait(30) == 0, node.output
        assert _inner_optimizer_saved(node) == optimizer
    for node in (*swarm, d):
        assert "Traceback" not in node.output, node.output
