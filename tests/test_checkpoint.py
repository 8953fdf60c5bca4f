import pytest
import torch
from safetensors.torch import load_file

from dtnode.daemon.checkpoints.file_format import (
    ABANDONED_DIR,
    CheckpointError,
    Layout,
    LocalState,
    TrainingState,
    file_sha256,
    list_checkpoints,
    local_state_path,
    prune_checkpoints,
    read_checkpoint,
    read_local_state,
    set_aside_checkpoints_after,
    write_checkpoint,
)

LAYOUT = Layout(("a.weight", "b.bias"), ((3, 4), (5,)))


def _state(theta=None, momentum=None):
    local = LocalState(torch.randn(LAYOUT.numel), torch.rand(LAYOUT.numel), torch.Generator().get_state(), 40, 40, 41)
    return TrainingState(
        theta if theta is not None else torch.randn(LAYOUT.numel),
        momentum if momentum is not None else torch.randn(LAYOUT.numel),
        local,
    )


def _write(tmp_path, step=1, run_id="run", model_hash="h"):
    state = _state()
    info = write_checkpoint(tmp_path, step, LAYOUT, state, {"run_id": run_id, "model_hash": model_hash})
    return info, state.theta_g, state.momentum


def test_round_trip_is_bit_identical_and_standard_safetensors(tmp_path):
    info, theta, momentum = _write(tmp_path, step=7)
    assert info.sha256 == file_sha256(info.path) and info.size_bytes == info.path.stat().st_size
    loaded = read_checkpoint(info.path, LAYOUT, "run", "h")
    assert loaded.step == 7 and torch.equal(loaded.theta_g, theta) and torch.equal(loaded.momentum, momentum)
    plain = load_file(str(info.path))  # readable by the safetensors library itself
    assert torch.equal(plain["theta_g/a.weight"], theta[:12].view(3, 4))
    local = read_local_state(tmp_path, 7, LAYOUT, "run", "h")
    assert (local.inner_step, local.adam_steps, local.batches_drawn) == (40, 40, 41)
    assert torch.equal(local.generator_state, torch.Generator().get_state())
    assert loaded.metadata["dtnode_version"]
    assert set(plain) == {"theta_g/a.weight", "theta_g/b.bias", "outer_momentum"}  # the shared file only


def test_the_error_feedback_buffer_is_kept_in_the_local_state_only(tmp_path):
    """What a sparse node has not sent yet is its own debt to the swarm: it survives a restart
    (the local file) and is never served to a joiner (the shared file), who starts without one."""
    state = _state()
    owed = torch.randn(LAYOUT.numel)
    state.local.error_feedback = owed
    info = write_checkpoint(tmp_path, 3, LAYOUT, state, {"run_id": "run", "model_hash": "h"})
    assert "outer/error_feedback" not in load_file(str(info.path))
    assert torch.equal(read_local_state(tmp_path, 3, LAYOUT, "run", "h").error_feedback, owed)
    _write(tmp_path, step=4)  # a node without a buffer writes none
    assert read_local_state(tmp_path, 4, LAYOUT, "run", "h").error_feedback is None
    state.local.error_feedback = torch.full((LAYOUT.numel,), float("nan"))
    write_checkpoint(tmp_path, 5, LAYOUT, state, {"run_id": "run", "model_hash": "h"})
    with pytest.raises(CheckpointError, match="non-finite"):
        read_local_state(tmp_path, 5, LAYOUT, "run", "h")


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "empty"])
def test_torn_or_corrupt_files_are_refused(tmp_path, damage):
    info, _, _ = _write(tmp_path)
    data = info.path.read_bytes()
    info.path.write_bytes(
        {"truncate": data[: len(data) - 10], "garbage_header": b"\xff" * 8 + data[8:], "empty": b""}[damage]
    )
    with pytest.raises(CheckpointError):
        read_checkpoint(info.path, LAYOUT, "run", "h")


def test_foreign_run_model_and_shape_are_refused(tmp_path):
    info, _, _ = _write(tmp_path, run_id="other")
    with pytest.raises(CheckpointError, match="run"):
        read_checkpoint(info.path, LAYOUT, "run", "h")
    info, _, _ = _write(tmp_path, step=2, model_hash="x")
    with pytest.raises(CheckpointError, match="model"):
        read_checkpoint(info.path, LAYOUT, "run", "h")
    info, _, _ = _write(tmp_path, step=3)
    wrong = Layout(("a.weight", "b.bias"), ((4, 3), (5,)))
    with pytest.raises(CheckpointError):
        read_checkpoint(info.path, wrong, "run", "h")


def test_non_finite_values_are_refused(tmp_path):
    theta = torch.randn(LAYOUT.numel)
    theta[3] = float("nan")
    info = write_checkpoint(tmp_path, 1, LAYOUT, _state(theta), {"run_id": "run", "model_hash": "h"})
    with pytest.raises(CheckpointError, match="non-finite"):
        read_checkpoint(info.path, LAYOUT, "run", "h")


def test_prune_keeps_newest(tmp_path):
    for step in range(5):
        _write(tmp_path, step=step)
    (tmp_path / ".ckpt-00000009.safetensors.tmp-999999999").write_bytes(b"torn")
    prune_checkpoints(tmp_path, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 3]
    assert not list(tmp_path.glob(".ckpt-*"))


def test_a_given_up_branch_is_set_aside_not_deleted_and_replaces_an_older_one(tmp_path):
    for step in range(6):
        _write(tmp_path, step=step)
    assert set_aside_checkpoints_after(tmp_path, 5) == []
    assert set_aside_checkpoints_after(tmp_path, 3) == [4, 5]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 2, 1, 0]
    aside = tmp_path / ABANDONED_DIR
    assert sorted(p.name for p in aside.iterdir()) == sorted(
        [f"ckpt-{s:08d}.safetensors" for s in (4, 5)] + [local_state_path(tmp_path, s).name for s in (4, 5)]
    )
    assert set_aside_checkpoints_after(tmp_path, 1) == [2, 3]  # a later branch replaces the earlier one
    assert sorted(p.name for p in aside.glob("ckpt-*")) == [f"ckpt-{s:08d}.safetensors" for s in (2, 3)]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 0]


WRITER = """
import sys, torch
from pathlib import Path
from dtnode.daemon.checkpoints.file_format import Layout, TrainingState, write_checkpoint
n = 96_000_000
layout = Layout(("w",), ((n,),))
state = TrainingState(torch.ones(n), torch.ones(n))
write_checkpoint(Path(sys.argv[1]), 2, layout, state, {"run_id": "run", "model_hash": "h"})
"""


def test_kill_9_during_a_write_leaves_the_previous_checkpoint_whole(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    big = Layout(("w",), ((96_000_000,),))
    state = TrainingState(torch.zeros(big.numel), torch.zeros(big.numel))
    first = write_checkpoint(tmp_path, 1, big, state, {"run_id": "run", "model_hash": "h"})
    del state
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size > 1 << 20 for p in tmp_path.glob(".ckpt-00000002*")):
        assert writer.poll() is None and time.monotonic() < deadline, "the writer finished before it could be killed"
        time.sleep(0.005)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]  # the torn write never got a checkpoint's name
    assert file_sha256(first.path) == first.sha256
    assert read_checkpoint(first.path, big, "run", "h").step == 1
    prune_checkpoints(tmp_path, keep=3)  # the dead writer's temp file is swept
    assert not list(tmp_path.glob(".ckpt-*"))


@pytest.mark.parametrize("outer_momentum", [True, False], ids=["momentum", "plain-sgd"])
def test_a_checkpoint_served_from_memory_is_the_file_byte_for_byte(tmp_path, outer_momentum):
    """Donors serving the current step from memory and donors serving its file are one file to
    a joiner (same sha256, same bytes at every offset); after `detach` the bytes stay put while
    the live tensors change."""
    from dtnode.daemon.checkpoints.file_format import TrainingState, write_checkpoint
    from dtnode.daemon.checkpoints.in_memory import MemoryCheckpoint

    layout = Layout(("a", "b"), ((3, 5), (7,)), outer_momentum)
    theta, momentum = torch.randn(layout.numel), torch.randn(layout.momentum_numel)
    meta = {"run_id": "r", "model_hash": "h"}
    info = write_checkpoint(tmp_path, 4, layout, TrainingState(theta.clone(), momentum.clone()), meta)
    memory = MemoryCheckpoint(4, layout, theta, momentum, meta)
    assert memory.hash() == info.sha256 and memory.size == info.size_bytes
    on_disk = info.path.read_bytes()
    assert memory.read(0, memory.size) == on_disk
    for offset, length in ((0, 8), (5, 100), (len(on_disk) - 10, 50), (60, 1)):
        assert memory.read(offset, length) == on_disk[offset : offset + length]
    memory.detach()
    theta.add_(1.0)  # what the next outer step would do
    assert memory.read(0, memory.size) == on_disk


def test_a_checkpoint_written_from_the_live_theta_is_whole_though_theta_changes_during_the_write(tmp_path, monkeypatch):
    """A CPU node writes `ckpt-N` from θ_g and the momentum in place (no model-sized copy): an
    outer step that comes while the file is being written first gives the writer copies
    (`detach`), so the file holds step N's values whole, byte for byte the file written from
    copies, and the live tensors move on."""
    from dtnode.daemon.checkpoints import in_memory as memory_checkpoint
    from dtnode.daemon.checkpoints.in_memory import MemoryCheckpoint

    monkeypatch.setattr(memory_checkpoint, "WRITE_SLICE", 24)  # several slices, a change between two
    layout = Layout(("a", "b"), ((3, 5), (7,)))
    theta, momentum = torch.randn(layout.numel), torch.randn(layout.numel)
    meta = {"run_id": "r", "model_hash": "h"}
    expected = write_checkpoint(tmp_path / "copies", 4, layout, TrainingState(theta.clone(), momentum.clone()), meta)
    live = MemoryCheckpoint(4, layout, theta, momentum, meta)
    pieces = live.pieces()

    class ChangesMidway:
        def pieces(self):
            for i, piece in enumerate(pieces):
                if i == 3:
                    live.detach()  # the store's hook, under the worker's lock, before the step
                    theta.add_(1.0)
                    momentum.mul_(0.5)
                yield piece

    state = TrainingState(theta, momentum, None, ChangesMidway())
    written = write_checkpoint(tmp_path / "live", 4, layout, state, meta)
    assert written.sha256 == expected.sha256 and written.path.read_bytes() == expected.path.read_bytes()
    assert not torch.equal(read_checkpoint(written.path, layout, "r", "h").theta_g, theta)  # they moved on


def test_stale_temp_files_are_swept_by_age_and_owner_even_under_pid_1(tmp_path):
    """In a container every run of the node is PID 1, so a dead writer's temp file names a pid
    that is alive (this one): it is swept once it is old, whoever's pid it names; a fresh one
    of a live pid may be a write under way and stays, and this process's own always stays."""
    import os
    import time

    from dtnode.daemon.checkpoints.file_format import RUN_TOKEN, STALE_TEMP_S

    old = time.time() - STALE_TEMP_S - 5
    dead_run = tmp_path / ".ckpt-00000003.safetensors.tmp-1"  # an earlier run's, PID 1, no tag
    dead_tagged = tmp_path / ".local-00000003.safetensors.tmp-1-0badcafe"
    fresh = tmp_path / ".ckpt-00000004.safetensors.tmp-1-0000beef"
    mine = tmp_path / f".ckpt-00000005.safetensors.tmp-{RUN_TOKEN}"
    for path in (dead_run, dead_tagged, fresh, mine):
        path.write_bytes(b"torn")
    for path in (dead_run, dead_tagged, mine):
        os.utime(path, (old, old))
    prune_checkpoints(tmp_path, keep=3)
    assert not dead_run.exists() and not dead_tagged.exists()
    assert fresh.exists() and mine.exists()


def _cpu_store(tmp_path):
    """A `tiny` model's worker on the CPU, and its checkpoint store in `tmp_path` (run "r",
    model "h", three checkpoints kept)."""
    from dtnode.daemon.checkpoints.store import CheckpointStore
    from dtnode.daemon.config.settings import NodeSettings
    from dtnode.daemon.telemetry.metrics import NodeMetrics
    from dtnode.daemon.training.worker import ModelWorker
    from dtnode.daemon.workload.build import build_workload

    settings = NodeSettings(state_dir=tmp_path, model="tiny", seq_len=16, fused_kernels=False, device="cpu")
    worker = ModelWorker(settings, build_workload(settings, tmp_path), torch.device("cpu"))
    worker.build("peer")
    store = CheckpointStore(
        tmp_path, worker, {"run_id": "r", "model_hash": "h"}, 3, NodeMetrics("0", "r", "tiny", "cpu"), set
    )
    return worker, store


def test_the_store_writes_theta_g_in_place_and_an_outer_step_during_the_write_keeps_the_file_whole(
    tmp_path, monkeypatch, caplog
):
    """The node's own checkpoint writes (CPU): θ_g and the momentum are read in place by the I/O
    thread, and an outer step (under the worker's lock) during the write makes the store hand the
    writer copies first: the file is the step's θ_g, the node's θ_g is the next one. A write on
    demand (for a joiner; a GPU node's way of serving the current step) says so in the log."""
    import asyncio
    import logging

    from dtnode.daemon.checkpoints import in_memory as memory_checkpoint
    from dtnode.daemon.checkpoints.in_memory import MemoryCheckpoint

    worker, store = _cpu_store(tmp_path)
    replica = worker.replica
    replica.outer_step = 3
    before = replica.theta_g.clone()
    monkeypatch.setattr(memory_checkpoint, "WRITE_SLICE", 4096)
    read_in_place = []
    pieces = MemoryCheckpoint.pieces

    def outer_step_midway(self):
        read_in_place.append(self)
        for i, piece in enumerate(pieces(self)):
            if i == 2:
                with worker.theta_changing():  # what an outer step landing now does first
                    replica.theta_g.add_(1.0)
                    replica.outer_step += 1
            yield piece

    monkeypatch.setattr(MemoryCheckpoint, "pieces", outer_step_midway)
    caplog.set_level(logging.INFO, logger="dtnode")
    try:
        asyncio.run(store.write(local=False))
    finally:
        worker.shutdown()
        store.shutdown()
    assert read_in_place and read_in_place[0].detached
    written = read_checkpoint(store.files[3].path, worker.layout, "r", "h")
    assert torch.equal(written.theta_g, before) and torch.equal(replica.theta_g, before + 1.0)
    assert not list(store._writing)  # the write let go of what it read
    assert sorted(store.files) == [3]  # written on demand: no cadence step had come


def test_a_scheduled_write_is_of_the_step_it_was_scheduled_at_though_an_outer_step_lands_next(tmp_path):
    """--overlap: once a round schedules its checkpoint, the next round's inner steps go to the
    training thread, and the previous average can land between two of them. The scheduled write
    is of the step it was scheduled at; a snapshot queued behind them took the next step, and
    the scheduled one was never written (an overlapped swarm missed its step-1 checkpoint)."""
    import asyncio

    worker, store = _cpu_store(tmp_path)
    replica = worker.replica
    replica.outer_step = 1
    scheduled = replica.theta_g.clone()

    def an_average_lands() -> None:
        with worker.theta_changing():
            replica.theta_g.add_(1.0)
            replica.outer_step += 1

    async def a_round_then_the_next_one() -> None:
        await store.schedule()
        await worker.call(an_average_lands)  # the next round, on the training thread at once
        await store.settle_write()

    try:
        asyncio.run(a_round_then_the_next_one())
    finally:
        worker.shutdown()
        store.shutdown()
    assert sorted(store.files) == [1]
    written = read_checkpoint(store.files[1].path, worker.layout, "r", "h")
    assert torch.equal(written.theta_g, scheduled)


@pytest.mark.parametrize("kernel", ["fused", "capturable", "foreach"])
def test_a_restored_adamw_step_count_lies_where_the_kernel_reads_it(kernel):
    """The fused and capturable AdamW kernels read the step count on the parameters' device (the
    fused CUDA kernel refuses one on the host), the others on the host: as torch's own
    load_state_dict puts it. ("meta" stands for a GPU here: the rule, not the kernel.)"""
    from dtnode.daemon.training.inner_state import step_count

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], **{kernel: True})
    count = step_count(optimizer, 7, torch.device("meta"))
    assert count.dtype == torch.float32 and count.shape == ()
    assert count.device.type == ("cpu" if kernel == "foreach" else "meta")


def test_a_swarm_without_outer_momentum_writes_and_serves_theta_g_alone(tmp_path):
    """Plain SGD (sparse's default) has no momentum: its file is θ_g alone, half the bytes a
    joiner downloads. Files stay readable across the change: a swarm without momentum reads an
    older file of zeros and ignores them, one with momentum starts it from zero on a file without."""
    plain = Layout(LAYOUT.names, LAYOUT.shapes, outer_momentum=False)
    theta = torch.randn(LAYOUT.numel)
    state = TrainingState(theta.clone(), torch.empty(0))
    info = write_checkpoint(tmp_path, 5, plain, state, {"run_id": "run", "model_hash": "h"})
    assert set(load_file(str(info.path))) == {"theta_g/a.weight", "theta_g/b.bias"}
    with_momentum, _, _ = _write(tmp_path, step=6)
    assert info.size_bytes < with_momentum.size_bytes - 4 * LAYOUT.numel + 64  # the header differs a little
    loaded = read_checkpoint(info.path, plain, "run", "h")
    assert torch.equal(loaded.theta_g, theta) and loaded.momentum.numel() == 0
    older = read_checkpoint(with_momentum.path, plain, "run", "h")  # written with momentum: not read
    assert older.momentum.numel() == 0
    assert read_checkpoint(info.path, LAYOUT, "run", "h").momentum.numel() == 0  # the outer optimizer zeroes it
    with pytest.raises(ValueError, match="layout"):
        write_checkpoint(tmp_path, 7, plain, TrainingState(theta, torch.zeros(LAYOUT.numel)), {})


def test_a_step_served_from_memory_and_then_from_its_file_is_announced_once():
    """A step's checkpoint is served from memory and then from its file, with one sha256: the
    record announces it once, so the steps before it are not pushed out of the few it holds."""
    from dtnode.daemon.checkpoints.served import RecentlyServed

    served = RecentlyServed(keep=3)
    for step in (1, 2, 3):
        served.add(step, f"sha{step}")  # from memory
        served.add(step, f"sha{step}")  # its file, the same bytes
    assert served.pairs() == [(1, "sha1"), (2, "sha2"), (3, "sha3")]
    served.add(4, "sha4")
    assert served.pairs() == [(2, "sha2"), (3, "sha3"), (4, "sha4")]  # the oldest added goes first
    served.add(2, "sha2")  # served again: newest again
    served.add(5, "sha5")
    assert served.pairs() == [(2, "sha2"), (4, "sha4"), (5, "sha5")]
    assert (4, "sha4") in served and (3, "sha3") not in served
