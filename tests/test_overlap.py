"""--overlap: training goes on while Δ is averaged; the average's outer step lands as soon as it is in."""

import asyncio
import threading

import pytest
import torch
from nodes import FAST, NodeProcess, step_floor, theta, wait_until

from dtnode.daemon.checkpoints.file_format import checkpoint_path, list_checkpoints
from dtnode.daemon.training.outer_replica import Replica
from dtnode.daemon.training.schedule import LearningRateSchedule
from dtnode.daemon.training.trainer import Trainer
from dtnode.daemon.workload.data import DataSources, DataStream, MarkovLanguage
from dtnode.daemon.workload.model import build_model
from dtnode.ops.flat import sha256_of


def _replica(peer: str, device: str = "cpu", outer_momentum: float = 0.9) -> Replica:
    model, _ = build_model("tiny", seed=1)
    language = MarkovLanguage(seed=2)
    stream = DataStream(DataSources(language, language), "run", peer, 4, 16)
    trainer = Trainer(
        model, stream, torch.device(device), schedule=LearningRateSchedule(1e-3), weight_decay=0.1, grad_clip=1.0
    )
    return Replica(trainer, outer_lr=0.7, outer_momentum=outer_momentum)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Δ goes to the host on a copy stream on CUDA only")
def test_on_cuda_the_copy_of_delta_is_whole_though_the_training_stream_overwrites_its_source_at_once():
    """pseudo_gradient and stage_delta return before Δ is on the host; the outer step that
    follows at once overwrites the device buffer the copy reads, and must wait for it on the
    device. Run on a GPU (not on this project's CPU CI)."""
    r = _replica("a", "cuda")
    flat = r.trainer.parameters_flat
    generator = torch.Generator(device="cuda").manual_seed(0)
    for staged in (r.pseudo_gradient, r.stage_delta, r.stage_delta):
        flat.add_(torch.randn(flat.shape, device="cuda", generator=generator))
        expected = (r.theta_g - flat).cpu()
        other_mean = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(1)).pin_memory()
        delta = staged()
        if r.has_in_flight:
            r.land(other_mean, None)  # writes the in-flight buffer the copy reads
        else:
            r.apply_outer_step(other_mean)  # writes the buffer the copy reads
        asyncio.run(r.delta_on_host())
        assert r.delta_copied()
        assert torch.equal(delta, expected)
    torch.cuda.synchronize()


def _model_sized(*holders: object) -> set[int]:
    """The storages of the model-sized tensors the objects hold as attributes."""
    found = set()
    for holder in holders:
        for value in vars(holder).values():
            if isinstance(value, torch.Tensor) and value.numel() >= 10_000:
                found.add(value.untyped_storage().data_ptr())
    return found


@pytest.mark.parametrize("momentum", [0.9, 0.0], ids=["momentum", "plain-sgd"])
def test_a_cpu_replica_holds_three_model_sized_buffers_through_its_rounds(momentum):
    """Host memory per parameter is what decides the largest model a node trains (a sharded
    host's rank 0 holds all of these in RAM): θ_g, the outer momentum and Δ's staging buffer,
    which the average comes back in (the all-reduce writes a part's result over Δ there once
    it is whole and checked), and with --overlap the Δ in flight, nothing more; an outer step
    allocates one slice at most, not another Δ. Without outer momentum, two: no buffer of zeros."""
    r = _replica("a", outer_momentum=momentum)
    flat = r.trainer.parameters_flat
    held = _model_sized(r, r.outer)
    buffers = (r.theta_g, r.outer.momentum_buffer, r.delta_cpu) if momentum else (r.theta_g, r.delta_cpu)
    assert held == {t.untyped_storage().data_ptr() for t in buffers}
    flat.add_(0.01)
    delta = r.pseudo_gradient()
    assert delta.data_ptr() == r.delta_cpu.data_ptr() and torch.allclose(delta, torch.full_like(delta, -0.01))
    r.apply_outer_step(delta)  # the average, in Δ's buffer
    assert torch.equal(flat, r.theta_g) and _model_sized(r, r.outer) == held
    mean = r.stage_delta()  # --overlap
    r.land(mean, None)
    assert _model_sized(r, r.outer) == held | {r._in_flight_buffer().untyped_storage().data_ptr()}


def test_a_replica_knows_how_far_its_outer_steps_move_theta_g_and_how_far_a_download_is():
    """The two figures a running node judges a split-vote download by (`daemon/catchup/trust_radius.py`)."""
    r = _replica("a")
    assert r.bounds.update_scale() is None  # no outer step yet: nothing to judge by
    sizes = []
    for scale in (1e-3, 4e-3, 2e-3):
        before = r.theta_g.clone()
        r.apply_outer_step(torch.full((r.numel,), scale))
        sizes.append(float((r.theta_g - before).norm()))
    assert max(sizes) <= r.bounds.update_scale() <= 2 * max(sizes)  # momentum 0.9: a bound, not an equality
    other = r.theta_g.clone()
    other[:10] += 3.0
    assert abs(r.distance_to(other) - (10 * 9) ** 0.5) < 1e-4
    with pytest.raises(ValueError):
        r.distance_to(other[:-1])


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_a_re_sync_averages_the_outer_momentum_only_where_there_is_one(momentum):
    """With outer momentum the consensus state is θ_g and the momentum; without (plain SGD,
    sparse's default) there is no buffer and a re-sync moves θ_g alone, half the bytes.
    Either way it is a copy: the averager writes the re-synced state into it, and θ_g may
    change only in the outer step."""
    r = _replica("a", outer_momentum=momentum)
    n = r.numel
    assert r.outer.momentum_buffer.numel() == (n if momentum else 0)  # no buffer of zeros without momentum
    r.outer.momentum_buffer.fill_(0.5)
    state = r.consensus_state()
    assert state.numel() == (2 * n if momentum else n)
    before = r.theta_g.clone()
    state.add_(1.0)
    assert torch.equal(r.theta_g, before)
    r.apply_outer_step(torch.zeros(n), state)  # a zero Δ: only the momentum moves θ_g
    buffer = 1.5 * momentum  # the re-synced momentum, one step of μ on
    assert torch.allclose(r.outer.momentum_buffer, torch.full((n if momentum else 0,), buffer))
    assert torch.allclose(r.theta_g, before + 1.0 - 0.7 * momentum * buffer)
    with pytest.raises(ValueError, match="consensus state"):
        r.apply_outer_step(torch.zeros(n), torch.zeros(n + 1))


def test_delayed_outer_step_keeps_own_progress_and_loses_no_delta():
    a, b = _replica("a"), _replica("b")
    stop = threading.Event()
    sent = {}
    # round 0: train, stage Δ_0 (nothing to apply yet)
    for name, r in (("a", a), ("b", b)):
        start = r.trainer.parameters_flat.clone()
        r.trainer.run(3, stop)
        sent[name] = r.delayed_outer_step(None, None).clone()
        assert torch.equal(start, r.theta_g)
        assert torch.equal(sent[name], start - r.trainer.parameters_flat)  # Δ_0 is round 0's progress...
        assert torch.equal(r.trainer.parameters_flat, r.theta_g - sent[name])  # ...and θ_l is untouched
        assert r.outer_step == 0
    mean0 = (sent["a"] + sent["b"]) / 2
    # round 1: train on, then apply the average of Δ_0 and stage Δ_1 = round 1's own progress
    for name, r in (("a", a), ("b", b)):
        before = r.trainer.parameters_flat.clone()
        r.trainer.run(3, stop)
        progress = before - r.trainer.parameters_flat
        delta1 = r.delayed_outer_step(mean0.clone(), None).clone()
        torch.testing.assert_close(delta1, progress, rtol=0, atol=1e-6)
        # θ_l is the new θ_g with the progress made since: the swarm's update replaced this peer's part
        torch.testing.assert_close(r.trainer.parameters_flat, r.theta_g - progress, rtol=0, atol=1e-6)
        assert r.outer_step == 1
        sent[name] = delta1
    assert sha256_of(a.theta_g) == sha256_of(b.theta_g)  # same mean on the same θ_g: bit-identical
    # round 2 on a: its average failed (None), so Δ_1 goes out again inside Δ_2, θ_g unchanged
    before_theta, before_local = a.theta_g.clone(), a.trainer.parameters_flat.clone()
    a.trainer.run(2, stop)
    progress = before_local - a.trainer.parameters_flat
    delta2 = a.delayed_outer_step(None, None)
    assert torch.equal(a.theta_g, before_theta) and a.outer_step == 1
    torch.testing.assert_close(delta2, sent["a"] + progress, rtol=0, atol=1e-6)
    # evaluating θ_g and the reset after a non-finite loss keep the invariant θ_l = θ_g − Δ in flight
    local = a.trainer.parameters_flat.clone()
    a.theta_g_into_model()
    assert torch.equal(a.trainer.parameters_flat, a.theta_g)
    a.restore_local()
    assert torch.equal(a.trainer.parameters_flat, local)
    # the last average, on the way out: nothing stays in flight
    a.land(delta2.clone(), None)
    assert a.outer_step == 2 and not a.has_in_flight
    torch.testing.assert_close(a.trainer.parameters_flat, a.theta_g, rtol=0, atol=1e-6)


def test_an_average_landing_between_inner_steps_keeps_the_progress_around_it():
    """The mean of round 0 lands after 2 of round 1's steps: θ_g moves at once, bit-identical
    across the group, θ_l keeps the 2 steps on top of it, and round 1's Δ is all of its steps."""
    a, b = _replica("a"), _replica("b")
    stop = threading.Event()
    sent = []
    for r in (a, b):
        r.trainer.run(3, stop)
        sent.append(r.delayed_outer_step(None, None).clone())
    mean0 = (sent[0] + sent[1]) / 2
    for r in (a, b):
        round_start = r.trainer.parameters_flat.clone()
        r.trainer.run(2, stop)
        before = r.trainer.parameters_flat.clone()
        r.land(mean0.clone(), None)
        assert r.outer_step == 1 and not r.has_in_flight
        torch.testing.assert_close(r.trainer.parameters_flat, r.theta_g - (round_start - before), rtol=0, atol=1e-6)
        landed = r.trainer.parameters_flat.clone()
        r.trainer.run(2, stop)
        delta1 = r.stage_delta().clone()
        torch.testing.assert_close(
            delta1, (round_start - before) + (landed - r.trainer.parameters_flat), rtol=0, atol=1e-6
        )
        assert r.has_in_flight and r.outer_step == 1
        torch.testing.assert_close(r.trainer.parameters_flat, r.theta_g - delta1, rtol=0, atol=1e-6)
    assert sha256_of(a.theta_g) == sha256_of(b.theta_g)
    # a failed average lands as nothing: θ_g stays, and the Δ in flight goes out again with the next
    theta_before, in_flight, before = a.theta_g.clone(), a.stage_delta().clone(), a.trainer.parameters_flat.clone()
    a.trainer.run(1, stop)
    progress = before - a.trainer.parameters_flat
    a.land(None, None)
    assert torch.equal(a.theta_g, theta_before) and a.outer_step == 1
    torch.testing.assert_close(a.stage_delta(), in_flight + progress, rtol=0, atol=1e-6)


@pytest.mark.long_swarms
def test_overlapped_swarm_keeps_one_theta_and_learns(tmp_path, cleanup):
    # rounds of several heartbeats: pacing reads progress from records published once a second, and
    # rounds shorter than that (15 tiny steps) let a loaded host's peer miss a group now and then
    # slowed steps (a round of 1-2 s) so that an average of the tiny model lands well inside the next round
    args = [*FAST, "--overlap", "--inner-steps", "40", "--min-peers", "3", "--max-rounds", "5", "--join-timeout", "90"]
    slow = {"DTNODE_TEST_SLOW_INNER": "3"}
    nodes = [NodeProcess.join("n0", tmp_path, *args, env=slow)]
    cleanup.append(nodes[0])
    for name in ("n1", "n2"):
        nodes.append(NodeProcess.join(name, tmp_path, *args, "--peer", nodes[0].join_address, env=slow))
        cleanup.append(nodes[-1])
    for node in nodes:
        assert node.wait(240) == 0, node.output
        assert "Traceback" not in node.output, node.output
        # round 0 has no average to apply yet; each later round applies the one before it
        history = node.rounds
        rounds = [(entry["round"], entry["groups"]) for entry in history]
        assert rounds[:5] == [(0, [])] + [(r, [[3, 3]]) for r in range(1, 5)], node.output
        assert max(step for step, _ in list_checkpoints(node.state_dir)) == 5  # the last average applied
        # each average's outer step lands during the next round's steps, not at its end
        landed = [(entry["landed_after_steps"], entry["inner_steps"]) for entry in history]
        assert landed[0][0] is None and all(0 <= after <= steps for after, steps in landed[1:]), landed
        assert any(after < steps for after, steps in landed[1:]), landed
    for step in range(1, 6):  # one group: the same mean on the same θ_g, bit for bit
        hashes = {sha256_of(theta(node.state_dir, step)) for node in nodes}
        assert len(hashes) == 1, (step, hashes)
    evals = [entry["eval_loss"] for entry in nodes[0].rounds if entry["eval_loss"] is not None]
    assert len(evals) == 4 and evals[-1] < evals[0] - 0.2, nodes[0].output  # rounds 1-4 (round 0: no θ_g yet)


def test_an_average_whose_landing_fails_lands_at_the_end_of_the_next_round(tmp_path, cleanup):
    """The outer step of round 1's average fails as it lands (`landing-error@1`, as when a local
    rank dies while θ_l is gathered): that round fails, and the average, still in, lands at the
    end of the next one. It once counted as landed though its step was never made, so the
    node's θ_g lacked a round (and a sharded host's last checkpoint too)."""
    args = [*FAST, "--overlap", "--min-peers", "1", "--max-rounds", "4"]
    node = NodeProcess.join("solo", tmp_path, *args, env={"DTNODE_TEST_FAILPOINT": "landing-error@1"})
    cleanup.append(node)
    assert node.wait(120) == 0, node.output
    assert "failed (FailpointError: failpoint landing-error@1 reached)" in node.output, node.output
    # each round's line shows the step its previous round's average made: none is missing
    assert [(r["round"], r["step"]) for r in node.rounds] == [(r, r) for r in range(4)], node.output
    assert max(step for step, _ in list_checkpoints(node.state_dir)) == 4


@pytest.mark.long_swarms  # about 35 s
def test_a_joiner_of_an_overlapped_swarm_takes_its_delayed_step_from_the_swarm(tmp_path, cleanup):
    """--overlap peers start round r from θ_g of step r-1 while round r-1 is averaged, and move
    to θ_g of step r once that average lands. A joiner enters round r from the newest θ_g a peer
    serves: step r-1 (then it takes the swarm's θ_g of step r at the round's end, instead of an
    outer step it had no part in) or step r already. From then on it averages with the others,
    and a round whose group held all three leaves all three one θ_g, bit for bit. If the swarm
    closed the round it entered before its first step (CI saw it once: the round closed during a
    0.2 s download), its Δ of that round finds no group, and from the next round on it averages
    with the others all the same.

    CI saw its first Δ go alone twice more: entering round r while round r-1 was averaged, its
    record looked like its peers', so their hop 0 of round r-1 waited for it, counted it a
    no-show, and did not wait for it in round r (now its record's `first_round` says r, published
    as it enters); and its catch-up fetched θ_g of step r only at the round's end, after its
    peers had formed their group (now fetched while the round trains)."""
    # rounds of a few seconds: a joiner needs about one to start training
    args = [*FAST, "--overlap", "--inner-steps", "60", "--join-timeout", "90"]
    slow = {"DTNODE_TEST_SLOW_INNER": "3"}
    a = NodeProcess.join("a", tmp_path, *args, "--min-peers", "2", env=slow)
    cleanup.append(a)
    b = NodeProcess.join("b", tmp_path, *args, "--min-peers", "2", "--peer", a.join_address, env=slow)
    cleanup.append(b)
    a.wait_for_round(lambda r: r["round"] >= 2, timeout=120)
    c = NodeProcess.join("c", tmp_path, *args, "--max-own-rounds", "3", "--peer", a.join_address, env=slow)
    cleanup.append(c)
    assert c.wait(120) == 0, c.output
    entered = c.rounds[0]["round"]
    # its first round's entry says where its θ_g came from: the download, then the swarm's θ_g
    # of that round's end when the download was of the step before
    # (twice downloaded when the swarm moved on while the first landed)
    synced = [(a["source"], a["step"]) for a in c.rounds[0]["synced"]]
    downloads = [step for source, step in synced if source == "downloaded"]
    assert downloads and synced[: len(downloads)] == [("downloaded", step) for step in downloads], synced
    if downloads[-1] == entered - 1:
        assert synced[len(downloads) :] == [("taken", entered)], c.rounds[0]
    else:
        assert downloads[-1] == entered and synced[len(downloads) :] == [], c.rounds[0]
    assert c.rounds[0]["groups"] == [] and all(not r["synced"] for r in c.rounds[1:]), c.output
    # From then on it averages with the others: a round whose group held all three gives all three
    # one θ_g, bit for bit. Not every round: the round it entered may close under its first steps
    # (its Δ then goes alone), and on 2 cores one node's view of the joiner's record lags another's
    # for a window, so one peer averaged a round without it (here: [[1, 2]] on a, [[2, 3]] on b
    # and c), or its last average went apart (CI); the next round's group re-syncs θ_g.
    together = [r for r in c.rounds[1:] if r["groups"] == [[3, 3]] and r["outcome"] == "full"]
    assert together, c.output
    for r in together:
        theirs = {_record(node, r["round"])["params_sha256"] for node in (a, b)}
        assert theirs == {r["params_sha256"]}, (r["round"], theirs, r, c.output)
    for node in (a, b):
        node.stop()
        assert node.wait(60) == 0, node.output
    for node in (a, b, c):
        assert "Traceback" not in node.output, node.output


@pytest.mark.long_swarms  # about 70 s
def test_a_node_restarted_into_an_overlapped_swarm_takes_the_average_it_missed(tmp_path, cleanup):
    """kill -9 of an --overlap peer, then a restart from its own checkpoint of step r while the
    swarm trains round r+1 with the average of round r in flight: the restarted node took no
    part in that average, so at its first round's end it takes the swarm's θ_g of step r+1 (as a
    joiner from a download does) instead of an outer step of its own. (Before, it trained on
    from step r alone and kept a θ_g of its own, which the groups never mended until the next
    --consensus-every re-sync.)"""
    # rounds longer than a restart (a few seconds on a loaded host), so the node comes back into
    # the round it left: one past its checkpoint's step
    args = [*FAST, "--overlap", "--inner-steps", "400", "--join-timeout", "90"]
    slow = {"DTNODE_TEST_SLOW_INNER": "3", **step_floor(0.05)}  # rounds of at least 20 s on a GPU host too
    a = NodeProcess.join("a", tmp_path, *args, "--min-peers", "3", env=slow)
    cleanup.append(a)
    b = NodeProcess.join("b", tmp_path, *args, "--min-peers", "3", "--peer", a.join_address, env=slow)
    cleanup.append(b)
    c = NodeProcess.join("c", tmp_path, *args, "--min-peers", "3", "--peer", a.join_address, env=slow)
    cleanup.append(c)
    # killed once it has a checkpoint past step 0: it restarts from that, early in the next round
    wait_until(lambda: any(step >= 1 for step, _ in list_checkpoints(c.state_dir)), 120, "c's first checkpoint")
    c.kill()
    c = NodeProcess.join("c", tmp_path, *args, "--max-own-rounds", "2", "--peer", a.join_address, env=slow)
    cleanup.append(c)
    assert c.wait(120) == 0, c.output
    first = c.rounds[-2]  # the first round after the restart: resumed from its own file, no download
    entered = first["round"]
    resumed = first["synced"][0]["step"]
    assert entered == resumed + 1, first
    assert [(a["source"], a["step"]) for a in first["synced"]] == [("resumed", resumed), ("taken", entered)], first
    # its θ_g of that step is a peer's. (The kill broke the average of round r that a and b ran
    # with it, so theirs may differ in the parts it owed; and its own Δ of round r+1 may reach the
    # group late and be averaged alone. Either way the next groups re-sync, as the drills show.)
    theirs = set()
    for node in (a, b):
        path = checkpoint_path(node.state_dir, entered)
        wait_until(
            path.exists,
            60,
            lambda node=node: f"checkpoint of step {entered} from {node.name}; output:\n{node.output[-3000:]}",
        )
        theirs.add(sha256_of(theta(node.state_dir, entered)))
        node.stop()
        assert node.wait(60) == 0, node.output
    assert sha256_of(theta(c.state_dir, entered)) in theirs, c.output
    for node in (a, b, c):
        assert "Traceback" not in node.output, node.output


def _record(node: NodeProcess, round_no: int) -> dict:
    """`node`'s history entry of round `round_no`, once it has one (a peer may record a round a
    moment after another does)."""
    node.wait_for_round(lambda r: r["round"] >= round_no, timeout=60)
    return next(r for r in reversed(node.rounds) if r["round"] == round_no)
