import pytest
import torch
from safetensors.torch import load_file

from dtnode.daemon.checkpoint import (
    CheckpointError, Layout, list_checkpoints, prune_checkpoints, read_checkpoint, write_checkpoint, file_sha256,
)

LAYOUT = Layout(("a.weight", "b.bias"), ((3, 4), (5,)))


def _write(tmp_path, step=1, run_id="run", model_hash="h"):
    theta = torch.randn(LAYOUT.numel)
    momentum = torch.randn(LAYOUT.numel)
    info = write_checkpoint(tmp_path, step, LAYOUT, theta, momentum, {"run_id": run_id, "model_hash": model_hash})
    return info, theta, momentum


def test_round_trip_is_bit_identical_and_standard_safetensors(tmp_path):
    info, theta, momentum = _write(tmp_path, step=7)
    assert info.sha256 == file_sha256(info.path) and info.size_bytes == info.path.stat().st_size
    loaded = read_checkpoint(info.path, LAYOUT, "run", "h")
    assert loaded.step == 7 and torch.equal(loaded.theta_g, theta) and torch.equal(loaded.momentum, momentum)
    plain = load_file(str(info.path))  # readable by the safetensors library itself
    assert torch.equal(plain["theta_g/a.weight"], theta[:12].view(3, 4))


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "empty"])
def test_torn_or_corrupt_files_are_refused(tmp_path, damage):
    info, _, _ = _write(tmp_path)
    data = info.path.read_bytes()
    info.path.write_bytes({"truncate": data[: len(data) - 10], "garbage_header": b"\xff" * 8 + data[8:],
                           "empty": b""}[damage])
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
    info = write_checkpoint(tmp_path, 1, LAYOUT, theta, torch.zeros(LAYOUT.numel), {"run_id": "run", "model_hash": "h"})
    with pytest.raises(CheckpointError, match="non-finite"):
        read_checkpoint(info.path, LAYOUT, "run", "h")


def test_prune_keeps_newest(tmp_path):
    for step in range(5):
        _write(tmp_path, step=step)
    (tmp_path / ".ckpt-00000009.safetensors.tmp-999999999").write_bytes(b"torn")
    prune_checkpoints(tmp_path, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 3]
    assert not list(tmp_path.glob(".ckpt-*"))
