"""A host with several local training ranks is one peer: exact DDP steps, mixed swarms, a
rank's failure, checkpoints that do not depend on the rank count (issue 32).

The ranks here are real processes over gloo on the CPU (`--nproc-per-node`), as on a CI
machine. Every test that starts ranks carries the `multi_rank` marker (.ci/run runs them after
the default suite, which must stay under 10 minutes on 2 cores)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from nodes import FAST_DEFAULT_OPTIMIZER, NodeProcess, dtnode_status, wait_until

from dtnode.daemon.checkpoints.file_format import (
    Layout,
    LocalState,
    TrainingState,
    list_checkpoints,
    read_local_state,
    write_checkpoint,
)
from dtnode.daemon.config.settings import NodeSettings, SettingsError
from dtnode.daemon.training.ranks.host import RankOutOfMemory, out_of_memory_line, plan_ranks, selected_gpus
from dtnode.daemon.training.worker import ModelWorker
from dtnode.daemon.workload.build import build_workload
from dtnode.daemon.workload.data import DataStream, open_sources
from dtnode.daemon.workload.model import build_model
from dtnode.ops.coded import CodedDelta
from dtnode.ops.flat import FlatParameters

ARGS = [*FAST_DEFAULT_OPTIMIZER, "--device", "cpu", "--threads-per-rank", "1"]


def _one_round(
    tmp: Path, ranks: int, batch: int, shard: bool = False, steps: int = 4, inner_optimizer: str = "adamw"
) -> tuple[torch.Tensor, torch.Tensor, int, float | None, torch.Tensor]:
    """θ_g after one round alone (H steps, the outer step of its own Δ), θ_l after a few more
    steps, the tokens counted, the held-out loss of θ_g and the inner optimizer's first
    moments, on a worker with `ranks` local ranks at per-rank `batch`."""
    settings = NodeSettings(
        inner_optimizer=inner_optimizer,
        shard=shard,
        eval_sequences=8,
        state_dir=tmp,
        model="tiny",
        batch_size=batch,
        seq_len=16,
        fused_kernels=False,
        device="cpu",
        nproc_per_node=ranks,
        threads_per_rank=1,
    )
    worker = ModelWorker(settings, build_workload(settings, tmp), torch.device("cpu"))
    try:
        worker.build("one-peer-id")  # the same id: the same token order
        worker.trainer.prefetch_batches = ranks > 1  # a GPU host's batch drawn ahead: the order must not change
        first = worker.trainer.run(steps, threading.Event())
        if shard:  # θ_l lives in the shards only: rank 0 let go of the first values once they were sent
            assert worker.trainer.flat.buffer.numel() == 0
        exact = worker.replica.theta_g - worker.trainer.local_copy()
        delta = worker.pseudo_gradient()
        # int8 (the default): rank 0 holds Δ coded, taken a parameter at a time when sharded;
        # each value within half a code of the exact one, which the step below takes
        assert isinstance(delta, CodedDelta)
        half_code = delta.scales.repeat_interleave(delta.block_size)[: exact.numel()] / 2
        assert bool(((delta.whole().decoded() - exact).abs() <= half_code * (1 + 1e-5) + 1e-12).all())
        worker.replica.apply_outer_step(exact)
        eval_loss = worker.trainer.eval_loss()
        moments = worker.trainer.inner_state()
        worker.trainer.load_inner_state(*moments)  # a resume's path: the moments go back to every rank
        worker.trainer.run(steps, threading.Event())  # θ_l after the outer step reached every rank
        theta, local = worker.replica.theta_g.clone(), worker.trainer.local_copy()
        _overlapped_landing_moves_theta_l_with_theta_g(worker)
        return theta, local, first.tokens, eval_loss, moments[0]
    finally:
        worker.shutdown()


def _overlapped_landing_moves_theta_l_with_theta_g(worker: ModelWorker) -> None:
    """--overlap's landing, on every rank: θ_l moves by θ_g's change plus the Δ in flight its
    mean replaces, added span by span (on a sharded host each rank adds to its shards)."""
    replica = worker.replica
    staged = replica.stage_delta()
    assert isinstance(staged, CodedDelta) and replica.has_in_flight
    in_flight = staged.whole().decoded()
    before_g, before_l = replica.theta_g.clone(), worker.trainer.local_copy()
    replica.land(staged, None)  # its own Δ as the mean: a round alone
    expected = before_l + (replica.theta_g - before_g) + in_flight
    scale = float(before_g.abs().max())
    torch.testing.assert_close(worker.trainer.local_copy(), expected, rtol=0, atol=1e-6 * scale)
    assert not torch.equal(replica.theta_g, before_g)


@pytest.mark.multi_rank
@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "shard"])
def test_two_ranks_at_batch_b_take_the_step_of_one_rank_at_batch_2b(tmp_path, shard):
    """2 ranks at per-rank batch 4 (DDP replicas, or FSDP2 shards with --shard) end a round
    with the θ_g of 1 rank at batch 8 on the same token order (fp32 tolerance), count the same
    tokens, evaluate the same held-out loss, hold the same AdamW moments, and keep every rank
    on the θ_l the outer step set (the steps after it agree too)."""
    one_theta, one_local, one_tokens, one_eval, one_moments = _one_round(tmp_path / "one", 1, 8)
    two_theta, two_local, two_tokens, two_eval, two_moments = _one_round(tmp_path / "two", 2, 4, shard)
    assert one_tokens == two_tokens == 4 * 8 * 16  # steps × rows × (seq_len targets)
    scale = float(one_theta.abs().max())
    torch.testing.assert_close(two_theta, one_theta, rtol=0, atol=1e-6 * scale)
    torch.testing.assert_close(two_local, one_local, rtol=0, atol=1e-6 * scale)
    assert one_eval is not None and two_eval == pytest.approx(one_eval, rel=1e-6)
    torch.testing.assert_close(two_moments, one_moments, rtol=1e-4, atol=1e-9)


@pytest.mark.multi_rank
@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "shard"])
def test_a_muon_host_of_two_ranks_steps_as_one_rank_to_bf16_rounding(tmp_path, shard):
    """--inner-optimizer muon on 2 ranks (DDP replicas, or FSDP2 shards whose matrices Muon
    gathers and orthogonalises whole) against 1 rank at twice the batch: Muon's Newton-Schulz
    iterations run in bf16 where the host has bf16 units (fp32 where it has not: muon.py), so
    the two agree to bf16's rounding at worst (about 1e-5 of a round's move), not to fp32's sum
    order alone; the momentum goes out to every rank and back (a resume's path) on both."""
    initial = FlatParameters(build_model("tiny", 0)[0].named_parameters()).buffer.clone()
    one_theta, one_local, one_tokens, _, one_moments = _one_round(tmp_path / "one", 1, 8, inner_optimizer="muon")
    two_theta, two_local, two_tokens, _, two_moments = _one_round(tmp_path / "two", 2, 4, shard, inner_optimizer="muon")
    assert one_tokens == two_tokens
    moved = one_theta[: initial.numel()] - initial
    gap = two_theta[: initial.numel()] - one_theta[: initial.numel()]
    assert float(moved.norm()) > 0 and float(gap.norm() / moved.norm()) < 1e-3
    assert float((two_local - one_local).norm() / (one_local[: initial.numel()] - initial).norm()) < 1e-3
    assert float((two_moments - one_moments).norm() / one_moments.norm()) < 1e-3


def test_gpu_selection_is_checked_against_the_host():
    assert selected_gpus("all", 4) == [0, 1, 2, 3]
    assert selected_gpus("0", 4) == [0]  # an index, as CUDA_VISIBLE_DEVICES numbers them
    assert selected_gpus("2", 4) == [2]
    assert selected_gpus("0,3", 4) == [0, 3]
    assert selected_gpus("3,", 4) == [3]
    for spec, message in (("5", "no GPU 5"), ("1,1", "twice"), ("0,7", "no GPU 7")):
        with pytest.raises(SettingsError, match=message):
            selected_gpus(spec, 4)
    assert NodeSettings(gpus="0").hardware.gpus == "0" and NodeSettings(gpus=" ALL ").hardware.gpus == "all"
    with pytest.raises(ValueError, match="write all, or GPU indices"):
        NodeSettings(gpus="zero")


def test_a_gpu_hosts_ranks_are_the_gpus_it_selects(tmp_path, monkeypatch):
    """The planning of a GPU host, on a CPU: torch's device answers stand in for the GPUs
    (mypy cannot see this branch: torch types a device's index as never None)."""
    from dtnode.daemon.training.ranks import host

    monkeypatch.setattr(host, "resolve_device", lambda spec: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    plan = plan_ranks(NodeSettings(state_dir=tmp_path, gpus="1,3"))
    assert plan.devices == (torch.device("cuda", 1), torch.device("cuda", 3)) and plan.backend == "nccl"
    assert plan_ranks(NodeSettings(state_dir=tmp_path, nproc_per_node=3)).world_size == 3
    with pytest.raises(SettingsError, match="3 ranks asked, but --gpus selects 2 GPUs"):
        plan_ranks(NodeSettings(state_dir=tmp_path, gpus="0,1", nproc_per_node=3))


def test_cpu_ranks_share_the_cores_and_a_single_device_has_one_rank(tmp_path):
    plan = plan_ranks(NodeSettings(state_dir=tmp_path, device="cpu", nproc_per_node=2))
    assert plan.world_size == 2 and plan.backend == "gloo" and plan.threads == max(1, (os.cpu_count() or 1) // 2)
    assert plan_ranks(NodeSettings(state_dir=tmp_path, device="cpu")).world_size == 1
    with pytest.raises(ValueError, match="nproc_per_node: --device cuda:0 is one device"):
        NodeSettings(state_dir=tmp_path, device="cuda:0", nproc_per_node=2)


def test_an_out_of_memory_line_names_the_rank_device_and_size():
    error = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 1 has ...")
    line = out_of_memory_line(1, "cuda:1", error)
    assert "local rank 1 on cuda:1" in line and "2.50 GiB" in line and "--batch-size" in line
    assert str(RankOutOfMemory(line)).startswith("--batch-size: local rank 1")


def _rank_children(node: NodeProcess) -> list[psutil.Process]:
    return [c for c in psutil.Process(node.proc.pid).children() if "dtnode.daemon.training.ranks.child" in c.cmdline()]


@pytest.mark.multi_rank
def test_hosts_of_one_and_two_ranks_average_in_one_group(tmp_path, cleanup):
    """Three hosts with 1, 2 and 2 ranks (the last sharded, --shard), 6 rounds in one group:
    every round full, the θ_g hashes agree, the same bytes per round from every host, each host one member whose
    /status lists its ranks, and no traceback in any log (the ranks log into their node's)."""
    # rounds of about 3 s, not 1: a sharded host's first steps (FSDP2's first gathers) took the
    # whole of a 1 s round 0, and a node that trained 2 steps to its peers' 29 holds the group's
    # mean to OUTER_REACH x its own Δ alone (update_bounds.py), splitting its θ_g from theirs
    args = [*ARGS, "--max-rounds", "6", "--target-group-size", "3", "--inner-steps", "45"]
    a = NodeProcess.join("a", tmp_path, *args, "--min-peers", "3")
    cleanup.append(a)
    b = NodeProcess.join("b", tmp_path, *args, "--nproc-per-node", "2", "--peer", a.join_address)
    c = NodeProcess.join("c", tmp_path, *args, "--nproc-per-node", "2", "--shard", "--peer", a.join_address)
    cleanup.extend([b, c])
    status = wait_until(
        lambda: (s := b.status()) and s["ranks"] and s["ranks"][1]["step_seconds"] > 0 and s, 120, "b's ranks"
    )
    assert [r["rank"] for r in status["ranks"]] == [0, 1] and status["device"] == "2xcpu"
    assert all(r["memory_bytes"] > 0 and r["tokens_per_s"] > 0 for r in status["ranks"]), status["ranks"]
    assert len(_rank_children(b)) == 1
    b.wait_for_round(timeout=120)
    assert 'dtnode_rank_tokens_per_second{device="cpu",rank="1"}' in b.get_text("/metrics").replace(
        'rank="1",device="cpu"', 'device="cpu",rank="1"'
    )
    shown = dtnode_status(b.http_url)
    assert shown.returncode == 0 and "local ranks: 2" in shown.stdout, shown.stdout + shown.stderr
    for node in (a, b, c):
        assert node.wait(300) == 0, node.output
    histories = [{r["round"]: r for r in node.rounds} for node in (a, b, c)]
    for number in range(6):
        entries = [h[number] for h in histories]
        assert all(e["groups"] == [[3, 3]] for e in entries), entries
        assert len({e["params_sha256"] for e in entries}) == 1, entries
    for number in range(6):  # a host's bytes on the wire do not depend on its rank count
        sent = [h[number]["bytes_sent"] for h in histories]
        assert max(sent) <= 1.02 * min(sent), sent
    for node in (a, b, c):
        assert "Traceback" not in node.output, node.output


@pytest.mark.multi_rank
def test_a_killed_rank_is_restarted_and_its_host_averages_again(tmp_path, cleanup):
    """kill -9 of one local rank mid-round: the host restarts its ranks from θ_g as the same
    peer and averages with the other host again; the other host never fails a round; a kill -9
    of the node leaves no orphaned rank."""
    # a run long enough that the other host does not finish it alone while the ranks restart
    # (its rounds without b last a fraction of a second: CI saw it end the run of 8 rounds first)
    args = [*ARGS, "--max-rounds", "40"]
    a = NodeProcess.join("a", tmp_path, *args, "--min-peers", "2")
    cleanup.append(a)
    b = NodeProcess.join("b", tmp_path, *args, "--nproc-per-node", "2", "--peer", a.join_address)
    cleanup.append(b)
    b.wait_for_round(lambda r: r["round"] >= 2, timeout=120)
    peer_id = b.status()["peer_id"]
    (child,) = _rank_children(b)
    child.send_signal(signal.SIGKILL)

    def restarts() -> int:
        status = b.status()
        return status["ranks"][1]["restarts"] if status and len(status["ranks"]) == 2 else 0

    wait_until(
        lambda: b.metric("dtnode_round_failures_total", reason="LocalRankFailure"),
        60,
        lambda: f"a round failed for its rank; output:\n{b.output[-6000:]}",
    )
    failed_at = len(b.rounds)
    wait_until(restarts, 60, lambda: f"the ranks restarted; output:\n{b.output[-6000:]}")
    # averaging again, in a full group of the two hosts. How many rounds the other host makes
    # alone meanwhile is not bounded here: its rounds alone last a fraction of a second on this
    # model, and the restarted ranks' first steps take seconds on a loaded 2-core host (CI saw
    # 6 such rounds before b was back, none of them a failure of either host)
    back = b.wait_for_round(lambda r: r["groups"] == [[2, 2]], timeout=120, after=failed_at)
    assert all(r["outcome"] != "failed" for r in b.rounds[failed_at:]), b.output
    assert b.status()["peer_id"] == peer_id and b.status()["ranks"][1]["restarts"] == 1
    assert "dtnode_local_rank_restarts_total 1.0" in b.get_text("/metrics")
    a.wait_for_round(lambda r: r["round"] >= back["round"], timeout=120)
    assert all(r["outcome"] != "failed" for r in a.rounds), a.rounds  # the other host kept its rounds
    children = _rank_children(b)
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(10)
    wait_until(
        lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children), 10, "no orphan"
    )
    assert "Traceback" not in a.output + b.output, b.output


@pytest.mark.multi_rank
def test_checkpoints_move_between_hosts_of_any_rank_count(tmp_path, cleanup):
    """A 2-rank host's checkpoint restores on a 1-rank joiner, and a 3-rank joiner restores
    what that swarm serves: both join in step, and all three then hold the same θ_g."""
    a = NodeProcess.join("a", tmp_path, *ARGS, "--nproc-per-node", "2", "--min-peers", "1")
    cleanup.append(a)
    a.wait_for_round(lambda r: r["round"] >= 1, timeout=120)
    b = NodeProcess.join("b", tmp_path, *ARGS, "--peer", a.join_address)
    cleanup.append(b)
    b.wait_for_round(timeout=120)
    c = NodeProcess.join("c", tmp_path, *ARGS, "--nproc-per-node", "3", "--peer", b.join_address)
    cleanup.append(c)
    first = c.wait_for_round(timeout=120)["round"]
    together = c.wait_for_round(lambda r: r["round"] > first and r["groups"] == [[3, 3]], timeout=120)
    b.wait_for_round(lambda r: r["round"] >= together["round"], timeout=60)
    a.wait_for_round(lambda r: r["round"] >= together["round"], timeout=60)
    for node in (a, b, c):
        node.proc.send_signal(signal.SIGTERM)
    for node in (a, b, c):
        assert node.wait(60) == 0, node.output
    for joiner in (b, c):  # each joined by a download (or two: the swarm moved on) of a host of another rank count
        synced = joiner.rounds[0]["synced"]
        assert synced and all(a["source"] == "downloaded" for a in synced), joiner.rounds[0]
    same = {node.name: node.round(together["round"])["params_sha256"] for node in (a, b, c)}
    assert len(set(same.values())) == 1, same
    assert "Traceback" not in a.output + b.output + c.output


@pytest.mark.multi_rank
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_sharded_host_whose_rank_dies_exits_for_its_supervisor(tmp_path, cleanup, overlap):
    """Under --shard the ranks cannot be restarted in place: the node says so in one line and
    exits 1 (not 2, which systemd's unit does not restart), leaving no rank behind. With
    --overlap the average still in flight lands in θ_g on the way out, though the shards of θ_l
    are gone with the ranks."""
    extra = ["--overlap"] if overlap else []
    node = NodeProcess.join("solo", tmp_path, *ARGS, "--nproc-per-node", "2", "--shard", "--min-peers", "1", *extra)
    cleanup.append(node)
    node.wait_for_round(timeout=120)
    (child,) = _rank_children(node)
    child.send_signal(signal.SIGKILL)
    assert node.wait(60) == 1, node.output
    assert "dtnode: error: a local rank failed under --shard" in node.output, node.output
    assert "Traceback" not in node.output and "failed on the way out" not in node.output, node.output
    steps = [step for step, _ in list_checkpoints(node.state_dir)]
    last = node.rounds[-1]["step"]
    if overlap:  # the last round's average was in flight: it lands, and the checkpoint holds it
        last = int(re.search(r"applied the last round's average: outer step (\d+)", node.output).group(1))
    assert steps and max(steps) == last, f"checkpoints {steps}, expected step {last}; output:\n{node.output}"


@pytest.mark.multi_rank
def test_a_node_with_ranks_stops_them_when_it_stops(tmp_path, cleanup):
    """SIGTERM ends a multi-rank node cleanly (exit 0, its children gone, no traceback)."""
    node = NodeProcess.join("solo", tmp_path, *ARGS, "--nproc-per-node", "2", "--min-peers", "1")
    cleanup.append(node)
    node.wait_for_round(timeout=120)
    children = _rank_children(node)
    assert len(children) == 1
    node.proc.send_signal(signal.SIGTERM)
    assert node.wait(60) == 0, node.output
    time.sleep(0.5)
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    assert "Traceback" not in node.output, node.output


def test_the_data_position_does_not_depend_on_the_rank_count(tmp_path):
    """A node's place in its corpus is counted in sequences: restarted with half the ranks
    (half the node's batch), it reads on from the same sequence, through its local checkpoint."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(chr(97 + (i * 7) % 26) for i in range(20_000)))
    sources = open_sources("run", 0, text, seq_len=16, cache_dir=tmp_path / "cache")
    two_ranks = DataStream(sources, "run", "peer", 8, 16)
    for _ in range(3):
        two_ranks.next_batch()
    generator, sequences = two_ranks.position()
    assert sequences == 24
    layout = Layout(("w",), ((4,),))
    zeros = torch.zeros(4)
    local = LocalState(zeros, zeros, generator, 3, 3, batches_drawn=3, sequences_drawn=sequences)
    write_checkpoint(
        tmp_path / "state", 1, layout, TrainingState(zeros, zeros, local), {"run_id": "r", "model_hash": "m"}
    )
    restored = read_local_state(tmp_path / "state", 1, layout, "r", "m")
    one_rank = DataStream(sources, "run", "peer", 4, 16)
    one_rank.seek(restored.generator_state, restored.sequences_drawn)
    reference = DataStream(sources, "run", "peer", 4, 16)
    expected = [reference.next_batch() for _ in range(7)][6]  # sequences 24..27
    assert torch.equal(one_rank.next_batch(), expected)
