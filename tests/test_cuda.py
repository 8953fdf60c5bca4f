"""The CUDA paths, on a GPU: the int8 and sparse codecs on the device, the trainer in bf16 with
and without `torch.compile`, the outer step with θ_g on the device, and the `--shard` helpers
over NCCL. Every test here skips on a host without CUDA (this project's CI); tests/bench/gpu.sh
runs them on a GPU machine."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dtnode.daemon.training.outer_replica import Replica
from dtnode.daemon.training.precision import Precision
from dtnode.daemon.training.schedule import LearningRateSchedule
from dtnode.daemon.training.trainer import Trainer
from dtnode.daemon.workload.data import DataSources, DataStream, MarkovLanguage
from dtnode.daemon.workload.model import build_model
from dtnode.ops import positions, quantization, sparse
from dtnode.ops.quantization import dequantize, quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _trainer(device: str, compile: bool = False, model: str = "tiny", precision: Precision = Precision.AUTO) -> Trainer:
    net, _ = build_model(model, seed=1)
    language = MarkovLanguage(seed=2)
    stream = DataStream(DataSources(language, language), "run", "peer", 8, 64)
    schedule = LearningRateSchedule(1e-3)
    return Trainer(
        net,
        stream,
        torch.device(device),
        schedule=schedule,
        weight_decay=0.1,
        grad_clip=1.0,
        compile=compile,
        precision=precision,
    )


@pytest.mark.parametrize("block", [64, 256])
def test_int8_codes_on_the_gpu_match_the_cpu_codes(block):
    """The same codes up to rounding: a GPU divides differently in the last bit (seen on an
    H100), so a code on a rounding boundary may differ by one. Every peer's wire codes are made
    on its host (the node's path), so peers never compare device codes with host codes."""
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0)) * 3
    cpu = quantize(x, block)
    gpu = quantize(x.cuda(), block)
    torch.testing.assert_close(gpu.scales.cpu(), cpu.scales, rtol=1e-6, atol=0)
    differ = (gpu.codes.cpu().int() - cpu.codes.int()).abs()
    assert int(differ.max()) <= 1 and float((differ > 0).float().mean()) < 1e-3
    error = (dequantize(gpu).cpu() - x).abs().reshape(-1)
    assert float(error.max()) <= float(cpu.scales.max()) * 0.5001


def test_the_fused_int8_kernels_on_the_gpu_equal_the_eager_ones():
    x = torch.randn(300_001, device="cuda") * 10
    eager = quantize(x, 256)
    assert quantization.use_fused_kernels(True)
    try:
        fused = quantize(x, 256)
        assert torch.equal(fused.codes, eager.codes) and torch.equal(fused.scales, eager.scales)
        assert torch.equal(dequantize(fused), dequantize(eager))
    finally:
        quantization.use_fused_kernels(False)


def test_the_sparse_codec_on_the_gpu_keeps_what_the_cpu_keeps():
    x = torch.randn(4096 * 50 + 123, generator=torch.Generator().manual_seed(3))
    cpu = sparse.decode(sparse.encode(x))
    gpu = sparse.decode(sparse.encode(x.cuda()))
    assert torch.equal((gpu != 0).cpu(), cpu != 0)  # the same support (random data: no ties)
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-6, atol=0)
    residual = torch.zeros_like(x, device="cuda")
    sent = torch.zeros_like(x, device="cuda")
    for _ in range(10):  # error feedback on the device: what was sent plus what is kept is every input
        sent += sparse.decode(sparse.encode_with_feedback(x.cuda(), residual))
    torch.testing.assert_close((sent + residual).cpu(), x * 10, rtol=0, atol=1e-4)
    assert float(residual.norm()) < float(x.norm()) * 10
    # a later moshpit hop's code of a group's mean (8-bit values on its support), on the device
    mean = cpu + sparse.decode(sparse.encode(torch.roll(x, 7)))
    torch.testing.assert_close(
        sparse.decode(sparse.encode_mean(mean.cuda(), k=128)).cpu(), sparse.decode(sparse.encode_mean(mean, k=128))
    )
    # the positions' Elias-Fano bytes, written and read on the device, are the CPU's bytes
    kept = sparse.encode(x)
    lengths = sparse.block_lengths(kept.numel, kept.block_size)
    on_cpu = positions.pack_positions(kept.indices, kept.counts, lengths)
    on_gpu = positions.pack_positions(kept.indices.cuda(), kept.counts.cuda(), lengths.cuda())
    assert torch.equal(on_gpu.cpu(), on_cpu)
    assert torch.equal(positions.unpack_positions(on_gpu, kept.counts.cuda(), lengths.cuda()).cpu(), kept.indices)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_the_trainer_learns_in_bf16_on_the_gpu(compile):
    trainer = _trainer("cuda", compile=compile)
    first = trainer.run(5, threading.Event())
    later = trainer.run(25, threading.Event())
    assert math.isfinite(first.mean_loss) and later.mean_loss < first.mean_loss
    assert trainer.parameters_flat.is_cuda and trainer.parameters_flat.dtype == torch.float32


@pytest.mark.parametrize("precision", [Precision.FP16, Precision.FP32])
def test_the_trainer_learns_in_fp16_with_its_loss_scale_and_in_fp32(precision):
    """--precision fp16 (a V100 or T4, which have no bf16) and fp32, on this GPU."""
    trainer = _trainer("cuda", precision=precision)
    assert Precision.AUTO.resolve(torch.device("cuda")) == Precision.BF16  # an H100/H200 has bf16
    first = trainer.run(5, threading.Event())
    later = trainer.run(25, threading.Event())
    assert math.isfinite(first.mean_loss) and later.mean_loss < first.mean_loss
    assert (trainer.precision.scaler is not None) == (precision == Precision.FP16)


def test_a_restored_adamw_state_trains_on_with_the_fused_kernel():
    """A checkpoint's or a download's AdamW moments installed on a GPU trainer: the fused CUDA
    kernel needs the step count on the device (it was on the host: every round after a restart
    or a late join failed, found by the swarm tests on an H100), and the steps go on from it."""
    source = _trainer("cuda")
    source.run(3, threading.Event())
    exp_avg, exp_avg_sq, steps = source.inner_state()
    restored = _trainer("cuda")
    restored.load_inner_state(exp_avg, exp_avg_sq, steps)
    later = restored.run(3, threading.Event())
    assert math.isfinite(later.mean_loss)
    assert restored.inner_state()[2] == steps + 3


def test_the_outer_step_on_the_gpu_matches_the_cpu():
    gpu, cpu = Replica(_trainer("cuda"), 0.7, 0.9), Replica(_trainer("cpu"), 0.7, 0.9)
    cpu.trainer.parameters_flat.copy_(gpu.trainer.parameters_flat.cpu())
    cpu.theta_g.copy_(gpu.theta_g.cpu())
    for seed in range(3):
        delta = torch.randn(gpu.theta_g.numel(), generator=torch.Generator().manual_seed(seed)) * 1e-3
        gpu.apply_outer_step(delta.clone().pin_memory())
        cpu.apply_outer_step(delta.clone())
        torch.testing.assert_close(gpu.theta_g.cpu(), cpu.theta_g, rtol=0, atol=1e-6)
    # what a running node judges a split-vote download by, read back from the device
    assert math.isclose(gpu.bounds.update_scale() or 0.0, cpu.bounds.update_scale() or 1.0, rel_tol=1e-4)
    assert math.isclose(gpu.distance_to(cpu.theta_g), 0.0, abs_tol=1e-4)


@pytest.mark.parametrize("momentum", [0.9, 0.0], ids=["momentum", "plain-sgd"])
def test_a_re_sync_with_theta_g_on_the_gpu_moves_the_averaged_state_through_the_host(momentum):
    """The consensus state leaves the device as a host copy (θ_g alone without momentum), and
    the averaged one comes back into θ_g and the momentum on the device at the outer step."""
    gpu = Replica(_trainer("cuda"), 0.7, momentum)
    n = gpu.numel
    gpu.outer.momentum_buffer.fill_(0.5)  # empty without momentum
    state = gpu.consensus_state()
    assert state.device.type == "cpu" and state.numel() == (2 * n if momentum else n)
    before = gpu.theta_g.to("cpu", copy=True)
    state.add_(1.0)  # what the group's average would write into it
    assert torch.equal(gpu.theta_g.cpu(), before)
    gpu.apply_outer_step(torch.zeros(n).pin_memory(), state)
    buffer = 1.5 * momentum
    torch.testing.assert_close(gpu.outer.momentum_buffer.cpu(), torch.full((n if momentum else 0,), buffer))
    torch.testing.assert_close(gpu.theta_g.cpu(), before + 1.0 - 0.7 * momentum * buffer)


def test_the_shard_helpers_round_trip_over_nccl(tmp_path: Path):
    """`--shard`'s scatter and gather of θ_l and the AdamW moments, over NCCL with FSDP2 on the
    GPU: a world of one rank here (NCCL refuses two ranks on one GPU), so the collectives and the
    DTensor plumbing run, not the split itself (the gloo tests split it on the CPU)."""
    from dtnode.daemon.training.ranks.fsdp import (
        gather_moments,
        gather_params,
        scatter_moments,
        scatter_params,
        shard_model,
    )

    device = torch.device("cuda", 0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    try:
        model, _ = build_model("tiny", seed=1)
        model.to(device)
        shard_model(model)
        params = list(model.parameters())
        sources = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
        scatter_params(params, lambda i, full: full.copy_(sources[i]), device)
        into = [torch.empty_like(s) for s in sources]
        gather_params(params, lambda i, full: into[i].copy_(full))
        assert all(torch.equal(a, b) for a, b in zip(into, sources))
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        moments = ([s * 0.1 for s in sources], [s.abs() * 0.01 for s in sources])
        scatter_moments(optimizer, params, moments, 7, device)
        numel = sum(p.numel() for p in params)
        flat = (torch.zeros(numel), torch.zeros(numel))
        assert gather_moments(optimizer, params, flat) == 7
        assert torch.equal(flat[0], torch.cat([m.reshape(-1) for m in moments[0]]))
        tokens = torch.randint(0, model.vocab_size, (4, 33), device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        assert math.isfinite(float(loss.detach()))
    finally:
        dist.destroy_process_group()
