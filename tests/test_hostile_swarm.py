"""One hostile member or outsider, or one dead member, among three honest real nodes (issue 56).

Each attack is the project's own build with one input changed, armed by a failpoint from round
1 on (peers/failpoints.py, daemon/swarm/hostile.py). The honest nodes must keep averaging with each
other, round after round, and their θ_g must stay within a few of their own outer steps.
Facts come from each node's history and checkpoints, not from its log. About 4 min on 2 cores
(-m long_swarms); `tests.bench.hostile` measures the same attacks against a clean run.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest
from nodes import FAST, NodeProcess, theta

ROUNDS = 5
HONEST = 3
# an honest outer step (or the distance between two honest θ_g of one step) within this many
# times the honest nodes' median outer step: an attacker that moved θ_g moves it by far more
# (the pair partner's -2.5 θ is hundreds of steps). What the design allows a step that follows
# a hostile re-sync: RESYNC_REACH (4) x the node's largest recent outer step, plus the step;
# the largest steps of a run whose rate and momentum still grow are about 1.5x its median
# (CI: 6.44x the median, h2 paired with the attacker twice, against a bound of 6 then)
BOUND = 8.0
LOSS_BOUND = 2.0


def _swarm(tmp_path: Path, attack_env: dict[str, str], extra_name: str = "attacker") -> tuple[list, NodeProcess]:
    args = [*FAST, "--max-rounds", str(ROUNDS), "--min-peers", str(HONEST + 1), "--target-group-size", str(HONEST + 1)]
    first = NodeProcess.join("h0", tmp_path, *args)
    address = first.join_address
    honest = [first, *(NodeProcess.join(f"h{i}", tmp_path, *args, "--peer", address) for i in range(1, HONEST))]
    extra = NodeProcess.join(extra_name, tmp_path, *args, "--peer", address, env=attack_env)
    return honest, extra


def _finish(honest: list[NodeProcess], extra: NodeProcess) -> None:
    try:
        for node in honest:
            assert node.wait(420) == 0, node.output[-3000:]
    finally:
        for node in [*honest, extra]:
            node.kill()
            node.wait(30)
            Path(str(node.state_dir) + ".log").write_text(node.output)
    for node in honest:
        assert "Traceback" not in node.output, node.name


def _steps(node: NodeProcess) -> list[int]:
    return sorted(int(p.stem.split("-")[-1]) for p in node.state_dir.glob("ckpt-*.safetensors"))


def _bounded(honest: list[NodeProcess]) -> None:
    """Every honest outer step, and every honest θ_g against the first node's of the same step,
    within BOUND x the honest nodes' median outer step (one steered round stands out); and the
    held-out loss of every round within LOSS_BOUND x round 0's, before the attack (an attack that
    steers every round moves the median too, not the loss)."""
    for node in honest:
        losses = [r["eval_loss"] for r in node.rounds if r["eval_loss"] is not None]
        assert losses and max(losses) <= LOSS_BOUND * losses[0], (node.name, losses)
    moves = [
        float((theta(n.state_dir, b) - theta(n.state_dir, a)).norm())
        for n in honest
        for a, b in itertools.pairwise(_steps(n))
    ]
    scale = statistics.median(moves)
    assert max(moves) <= BOUND * scale, (max(moves), scale)
    reference = honest[0]
    for node in honest[1:]:
        for step in set(_steps(node)) & set(_steps(reference)):
            apart = float((theta(node.state_dir, step) - theta(reference.state_dir, step)).norm())
            assert apart <= BOUND * scale, (node.name, step, apart, scale)


def _averaged_together(honest: list[NodeProcess]) -> None:
    """From round 1 on (the attack's), every honest round met another peer in every hop; a node
    may end a round short of --max-rounds (it stops with a swarm that finished while it was in
    the last round's deadline, waiting for a member that registered and sent nothing)."""
    for node in honest:
        later = [r for r in node.rounds if r["round"] >= 1]
        assert len(later) >= ROUNDS - 2, (node.name, later)
        assert all(r["groups"] and all(size >= 2 for size, _ in r["groups"]) for r in later), (node.name, later)


@pytest.mark.long_swarms
@pytest.mark.parametrize(
    "attack",
    ["hostile-leader", "hostile-shadow", "hostile-pair", "hostile-zero-weight", "hostile-delta"],
)
def test_one_hostile_peer_neither_stalls_the_honest_swarm_nor_steers_its_theta(tmp_path, attack, cleanup):
    """Findings 1, 2, 4 and 5: a leader that never closes its groups (it held them forever), an
    outsider's plain values over the swarm's keys (everyone read nobody), a pair partner
    re-syncing θ_g to -2.5 θ (it was within 4‖θ‖), a zero weight with a 1e12 claim (every cap
    was off), a member sending Δ x1000 in the plain mean (each node scaled the mean by its own
    factor, the honest θ_g split and the held-out loss grew 10x). The honest nodes finish their
    rounds together, within the bound; the silent leader is benched after its first round."""
    honest, extra = _swarm(tmp_path, {"DTNODE_TEST_FAILPOINT": f"{attack}@1"})
    _finish(honest, extra)
    _averaged_together(honest)
    _bounded(honest)
    if attack == "hostile-delta":
        _one_theta_and_learning(honest)
    if attack == "hostile-leader":
        _benched_after_its_first_round(honest)


def _benched_after_its_first_round(honest: list[NodeProcess]) -> None:
    """The silent member (it registers, then neither closes, reduces nor sends) let round 1's
    group down, so every honest node benched it (peers/absentees.py): rounds 2 and 3 are whole
    groups of the honest nodes alone, and end with one θ_g. Before the bench it sat in every
    group, failed its part of every all-reduce, and the honest θ_g parted every round."""
    for r in (2, 3):
        records = [node.round(r) for node in honest]
        assert all(rec is not None and rec["outcome"] == "full" for rec in records), (r, records)
        assert all(rec["groups"] == [[HONEST, HONEST]] for rec in records), (r, records)
        assert len({rec["params_sha256"] for rec in records}) == 1, (r, records)


def _one_theta_and_learning(honest: list[NodeProcess]) -> None:
    """The plain mean under a member's Δ x1000: every reducer clips it alike, so the honest nodes
    end every round with one θ_g, and their held-out loss falls (before the clip, each node scaled
    the attacker-made mean by its own factor: their θ_g split and the loss rose from round 2)."""
    for r in range(ROUNDS):
        hashes = {rec["params_sha256"] for node in honest if (rec := node.round(r)) is not None}
        assert len(hashes) <= 1, (r, {node.name: node.round(r) for node in honest})
    for node in honest:
        losses = [rec["eval_loss"] for rec in node.rounds if rec["eval_loss"] is not None]
        assert losses[-1] < losses[0], (node.name, losses)


@pytest.mark.long_swarms
def test_a_member_killed_after_its_group_formed_costs_the_others_seconds_not_the_deadline(tmp_path, cleanup):
    """Finding 3: a member killed after its round-0 group formed (before its first stream, and
    before any rate was measured, so the all-reduce deadline is its bound: 48 s of 60) held the
    survivors' round until that deadline. Its reducers now dial it and drop it within seconds."""
    honest, extra = _swarm(tmp_path, {"DTNODE_TEST_FAILPOINT": "grouped@0"}, extra_name="killed")
    _finish(honest, extra)
    assert extra.proc.returncode != 0  # it died where it was meant to
    rounds = [node.round(0) for node in honest]
    assert all(r is not None for r in rounds)
    # the deadline was 0.8 x 60 s; a dial fails twice a second apart, plus a settle and the flush
    assert max(r["phases_s"]["allreduce"] for r in rounds) < 15, rounds
