"""Moshpit averaging between real node processes: a 3x3 grid in consensus, a stalled peer, and a
paused one in a swarm of several groups."""

import re
import signal
import time

import pytest
import torch
from nodes import FAST, NodeProcess, step_floor, theta, time_paced_swarm, wait_until

# nine nodes and their nine p2pd daemons on CI's 2 cores starve one another for seconds: the
# adaptive all-reduce deadline's floor (3 s by default, a tiny model's transfer being quick) made
# a reducer drop a sender that was late by that much, and the grid's consensus with it
GRID = [
    *FAST,
    "--target-group-size",
    "3",
    "--allreduce-timeout",
    "10",
    "--allreduce-timeout-min",
    "8",
    "--matchmaking-window",
    "6",
]
PAIRS = [*FAST, "--target-group-size", "2", "--allreduce-timeout", "10", "--matchmaking-window", "6"]


def _start(tmp_path, cleanup, n: int, *extra: str, env: dict[str, str] | None = None) -> list[NodeProcess]:
    first = NodeProcess.join("n0", tmp_path, *GRID, "--min-peers", str(n), *extra, env=env)
    cleanup.append(first)
    address = first.join_address
    nodes = [first]
    for i in range(1, n):
        node = NodeProcess.join(f"n{i}", tmp_path, *GRID, "--min-peers", str(n), "--peer", address, *extra, env=env)
        cleanup.append(node)
        nodes.append(node)
    return nodes


@pytest.mark.long_swarms
def test_nine_nodes_on_a_3x3_grid_stay_in_consensus(tmp_path, cleanup):
    """Two hops of groups of three: every node holds the global mean of Δ after each step,
    so all nine θ_g agree bit for bit though no group ever held more than three."""
    nodes = _start(tmp_path, cleanup, 9, "--max-rounds", "3", "--log-level", "DEBUG")
    for node in nodes:
        assert node.wait(240) == 0, node.output
    # every node's groups, hop by hop, and what went wrong: the whole swarm's story on failure
    story = "\n".join(
        f"{node.name} {line}"
        for node in nodes
        for line in node.lines
        if re.search(r"round \d+ (hop|\|)|leader|another list|WARN|Traceback", line)
    )
    for node in nodes:
        rounds = node.rounds
        assert [r["round"] for r in rounds] == [0, 1, 2], story
        # two hops, every group held every member it expected (cells are hashed: sizes vary)
        assert all(len(r["groups"]) == 2 and all(s == e for s, e in r["groups"]) for r in rounds), story
        assert "Traceback" not in node.output, node.output
    for step in (1, 2, 3):
        # every group of hop 1 averaged one mean of each row of hop 0, whoever reduced it and in
        # whatever order its chunks arrived (reducers add in a fixed order): one θ_g, bit for bit
        reference = theta(nodes[0].state_dir, step)
        assert all(torch.equal(theta(node.state_dir, step), reference) for node in nodes[1:]), story
    losses = [r["eval_loss"] for r in nodes[0].rounds]
    assert losses[-1] < losses[0]


# the scale bench's settings (tests/bench/scale.py): rounds paced by time, every inner step at
# least 1 s (DTNODE_TEST_STEP_FLOOR_S), so that 16 nodes' training leaves 2 cores to what the swarm
# itself costs (matchmaking, the DHT, the all-reduces), as hosts training on accelerators do
# The all-reduce deadline's floor at 10 s, as the scale bench's --allreduce-timeout-min: 48
# processes on 2 cores starve one another's streams for seconds in the hop that all 16 run at
# once, which hosts of their own do not; at the 3 s floor one stream in a hop 1 of a CI run was
# cut at 4.2 s, the first cut of the run (the deadline grows after a cut, not before one).
SIXTEEN = [
    *time_paced_swarm(16, rounds=5, round_seconds=10, group_size=4, join_timeout=600),
    "--allreduce-timeout-min",
    "10",
]


@pytest.mark.long_swarms  # about 2.5 min on 2 cores
@pytest.mark.timeout(600)  # pyproject's 300 s is the default suite's; a loaded host takes longer
def test_sixteen_nodes_average_in_full_groups_and_mend_any_split_of_theta_in_one_round(tmp_path, cleanup):
    """Issue 60: a swarm of 16 real nodes on a 4x4 grid (groups of 4, two hops), 5 rounds. At
    least 95% of the nodes' rounds end `full` (each group the node joined held every member it
    expected, no part failed: issue 60's figure), every round has both hops on every node, and
    all 16 hold one θ_g (one params_sha256 in their histories) after every round but one at most,
    whose split the next round's groups mend.

    Not every round of every node: on 2 cores a node's view of the round's peers now and then
    lags (a heartbeat late under load), and it reads another hop-0 cell than its peers do. CI:
    in the last round two nodes averaged hop 0 alone and four others' groups missed them
    (`partial`, 4 of 80 node-rounds); hop 1 brought all 16 to one θ_g as in every round. A later
    CI run split round 0 into 4 θ_g, its groups full but for a few nodes (CI printed two logs;
    two causes fit: a node's record missing from some views as the 16 started, which left it
    out of the hop-1 groups those views traced, closed full without its share (such a peer is
    now traced by its hop-0 record, `GroupExpectations._vouch`); or a part cut at its deadline,
    whose group carries another mean into complete last-hop groups, as in the 32-node runs of
    docs/results/scale.md); the members of round 1's hop 0 saw their hashes differ and re-synced
    (`MoshpitAverager`), as a swarm does after any split (the two logs CI printed agree from
    round 1 on). A split that the next round did not mend, or two, still fails here."""
    env = {"OMP_NUM_THREADS": "1", **step_floor(1.0)}
    first = NodeProcess.join("n00", tmp_path, *SIXTEEN, env=env)
    cleanup.append(first)
    nodes = [first]
    for i in range(1, 16):
        node = NodeProcess.join(f"n{i:02d}", tmp_path, *SIXTEEN, "--peer", first.join_address, env=env)
        cleanup.append(node)
        nodes.append(node)
    for node in nodes:
        assert node.wait(600) == 0, node.output
    histories = {node.name: node.rounds for node in nodes}
    story = {
        name: [(r["round"], r["outcome"], r["groups"], r["reasons"]) for r in rounds]
        for name, rounds in histories.items()
    }
    for rounds in histories.values():
        assert [r["round"] for r in rounds] == list(range(5)), story
        assert all(len(r["groups"]) == 2 for r in rounds), story
    outcomes = [r["outcome"] for rounds in histories.values() for r in rounds]
    assert outcomes.count("full") >= 0.95 * len(outcomes), story
    thetas = [{rounds[r]["params_sha256"] for rounds in histories.values()} for r in range(5)]
    split = [r for r, hashes in enumerate(thetas) if len(hashes) > 1]
    # one round at most splits θ_g, and the next one's groups mend it (so the last one holds one)
    assert len(split) <= 1 and 4 not in split, (split, story)
    for node in nodes:
        assert "Traceback" not in node.output, node.output


@pytest.mark.long_swarms
def test_a_stalled_peer_costs_the_others_one_bounded_round_and_catches_up(tmp_path, cleanup):
    """SIGSTOP one of four nodes (groups of up to three) while it is matchmaking: the others finish that outer step
    without it (their windows and all-reduce deadlines bound the wait); after SIGCONT the
    stalled node catches up (resync or the next step) and averages with the others again."""
    # rounds of at least 1.2 s, a GPU host's too: the others must not end all 12 rounds during the stall
    nodes = _start(tmp_path, cleanup, 4, "--max-rounds", "12", env=step_floor(0.08))
    stalled, others = nodes[-1], nodes[:-1]
    stalled.wait_for_round(lambda r: r["round"] >= 1, timeout=180)
    status = wait_until(lambda: (s := stalled.status()) and s["state"] == "averaging" and s, 120, "averaging")
    step = status["outer_step"]
    stalled.stop(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        for node in others:  # a hang guard, not a speed check: the deadlines end the step
            node.wait_for_round(lambda r: r["round"] >= step, timeout=120)
        time.sleep(max(0.0, 8 - (time.monotonic() - stopped_at)))  # well past its heartbeats' expiry
    finally:
        stalled.stop(signal.SIGCONT)
    for node in nodes:
        assert node.wait(240) == 0, node.output
    # it came back in step with the swarm: groups with others in the steps after the stall. In
    # any hop: cells are hashed from the peer ids, so a node may be alone in hop 0 every round
    # (`groups 1/1 3/3`) and meet the others in hop 1
    later = [r for r in stalled.rounds if r["round"] > step]
    assert any(size > 1 for r in later for size, _ in r["groups"]), stalled.output


@pytest.mark.long_swarms
def test_a_paused_node_of_a_swarm_of_several_groups_downloads_its_state_rather_than_training_alone(tmp_path, cleanup):
    """Six nodes in groups of two: each step ends with several θ_g (one per last group), and
    often no file has a majority of hosts. A node paused for a few rounds (SIGSTOP) refused
    every such file, trained the rounds it missed alone (5 of them, measured), then averaged on
    from a θ_g nobody shared. Now it takes the most-served file within reach of its own θ_g."""
    nodes = []
    for i in range(6):
        extra = ["--peer", nodes[0].join_address] if nodes else []
        node = NodeProcess.join(
            f"n{i}", tmp_path, *PAIRS, "--min-peers", "6", "--max-rounds", "18", *extra
        )  # rounds left after the resume, on a loaded host too
        cleanup.append(node)
        nodes.append(node)
    paused = nodes[-1]
    paused.wait_for_round(lambda r: r["round"] >= 2, timeout=240)
    paused.stop(signal.SIGSTOP)
    try:
        left_at = paused.rounds[-1]["round"]
        nodes[0].wait_for_round(lambda r: r["round"] >= left_at + 4, timeout=240)
    finally:
        paused.stop(signal.SIGCONT)
    for node in nodes:
        assert node.wait(300) == 0, node.output
        assert "Traceback" not in node.output, node.output
    downloaded = [a["step"] for r in paused.rounds for a in r["synced"] if a["source"] == "downloaded"]
    assert downloaded and max(downloaded) >= left_at + 4, paused.rounds  # caught up by a download
    after = [r for r in paused.rounds if r["round"] > left_at]
    alone = [r["round"] for r in after if all(size <= 1 for size, _ in r["groups"])]
    assert len(alone) <= 1, (alone, paused.output)  # the round it was in when it stopped, at most
