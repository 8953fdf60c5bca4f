"""A swarm users will run, kept out of CI for its length: `-m soak` (about 7 minutes on 2 cores)."""

import signal
import time

import pytest
from nodes import NodeProcess

SMALL_SPARSE_PAIRS = [
    "--model",
    "small",
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    "--inner-steps",
    "4",
    "--compression",
    "sparse",
    "--target-group-size",
    "2",
    "--allreduce-timeout",
    "60",
    "--min-peers",
    "6",
]
ROUNDS = 6


@pytest.mark.soak
@pytest.mark.timeout(1800)  # about 6 minutes on 2 cores; pyproject's 300 s is the default suite's
def test_six_small_sparse_peers_in_pairs_agree_through_a_pause_and_a_restart(tmp_path, cleanup):
    """Six nodes of `small` (25M parameters) in sparse mode, in groups of 2 (three hops, so
    peers stand in several classes and views of a group can differ), one with twice the batch;
    one is paused 10 s in round 2 and another stopped after round 2 and started again.

    This swarm found five faults (docs/design.md, items 3 and 4, and docs/security.md): a
    member counted in a group it never formed stalled that group until the deadline and failed
    all its parts (a 51 s hop, θ_g split in two); a sender gave up on a reducer that formed the
    group seconds late (θ_g split four ways); a member alone in a later hop kept a group's mean
    whole where the group beside it returned the code's cut; later hops stopped waiting for peers
    whose records lapsed for a few seconds on the loaded host; and a θ_g re-sync weighed one mean
    by how many members brought it, so two groups re-synced to different θ_g. Before the last
    three, 4 of 5 runs split θ_g in 1 to 3 rounds of 6. Asked: every node exits cleanly with no
    traceback; the nodes that trained a round agree on θ_g in every round; a node misses a round
    only for its restart, and at most one more in the whole run."""
    args = [*SMALL_SPARSE_PAIRS, "--max-rounds", str(ROUNDS)]
    nodes = [NodeProcess.join("n0", tmp_path, *args)]
    cleanup.append(nodes[0])
    first = nodes[0].join_address
    for i in range(1, 6):
        nodes.append(
            NodeProcess.join(f"n{i}", tmp_path, *args, "--peer", first, *(["--batch-size", "16"] if i == 2 else []))
        )
        cleanup.append(nodes[-1])
    paused, restarted = nodes[5], nodes[3]
    paused.wait_for_round(lambda r: r["round"] >= 1, timeout=600)
    paused.stop(signal.SIGSTOP)
    time.sleep(10)
    paused.stop(signal.SIGCONT)
    restarted.wait_for_round(lambda r: r["round"] >= 2, timeout=600)
    restarted.stop()
    assert restarted.wait(120) == 0, restarted.output
    again = NodeProcess.join("n3", tmp_path, *args, "--peer", first)
    cleanup.append(again)
    nodes[3] = again
    for node in nodes:
        assert node.wait(1200) == 0, node.output
    for node in [*nodes, restarted]:
        assert "Traceback" not in node.output, node.output
    hashes: dict[int, set[str]] = {}
    missed = 0
    for node in nodes:  # the restarted node's history holds its rounds from before the restart too
        trained = {r["round"]: r["params_sha256"] for r in node.rounds}
        missed += sum(1 for r in range(ROUNDS) if r not in trained)
        for r, sha in trained.items():
            hashes.setdefault(r, set()).add(sha)
    split = [r for r in range(ROUNDS) if len(hashes.get(r, ())) != 1]
    assert not split, {r: sorted(h) for r, h in hashes.items()}
    assert missed <= 2, [(n.name, [r["round"] for r in n.rounds]) for n in nodes]
