"""`--inner-optimizer muon` (issue 59): Muon on the hidden matrices, AdamW on the rest, as one
optimizer whose state goes through the node's flat moments, its local checkpoint and a restart
bit for bit; a file of another optimizer's moments starts the inner state fresh."""

from __future__ import annotations

import copy

import pytest
import torch

from dtnode.daemon.checkpoints.file_format import (
    CheckpointError,
    Layout,
    LoadedCheckpoint,
    LocalState,
    TrainingState,
    read_local_state,
    write_checkpoint,
)
from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.config.training_options import InnerOptimizerKind
from dtnode.daemon.training import muon as muon_module
from dtnode.daemon.training.inner_optimizer import (
    MuonWithAdamW,
    build_inner_optimizer,
    hidden_matrices,
    moment_names,
    state_bytes,
)
from dtnode.daemon.training.inner_state import flat_moments, install_inner_state, ordered_parameters
from dtnode.daemon.training.inner_step import inner_step
from dtnode.daemon.training.muon import Muon
from dtnode.daemon.training.worker import ModelWorker
from dtnode.daemon.workload.build import build_workload
from dtnode.daemon.workload.model import build_model, config_hash
from dtnode.ops.flat import FlatParameters


def _batches(n: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (4, 17), generator=g) for _ in range(n)]


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[float]:
    params = ordered_parameters(model)
    return [inner_step(model, optimizer, b, torch.device("cpu"), 1.0, params) for b in batches]


def _meta(description: dict) -> dict[str, str]:
    return {"run_id": "run", "model_hash": config_hash(description)}


def test_muon_takes_the_blocks_matrices_and_adamw_the_embeddings_gains_and_biases():
    model, _ = build_model("tiny", 0)
    names = {id(p): name for name, p in model.named_parameters()}
    taken = {names[i] for i in hidden_matrices(model)}
    assert taken and all(".weight" in name and name.startswith("blocks.") for name in taken)
    assert not any(name.startswith(("tok.", "pos.")) for name in taken)  # the tied head is tok.weight
    for name, p in model.named_parameters():
        if p.dim() == 2 and name.startswith("blocks."):
            assert name in taken, name
    optimizer = build_inner_optimizer(model, 1e-3, 0.1, InnerOptimizerKind.MUON)
    assert isinstance(optimizer, MuonWithAdamW)
    # one list of groups, the halves' own dicts: the schedule's rate reaches both
    for group in optimizer.param_groups:
        group["lr"] = 0.5
    assert {g["lr"] for g in optimizer.muon.param_groups + optimizer.adamw.param_groups} == {0.5}


def test_a_muon_step_holds_half_the_state_of_adamws_on_the_matrices():
    model, _ = build_model("tiny", 0)
    batches = _batches(2, 256)
    muon_model = copy.deepcopy(model)
    adamw = build_inner_optimizer(model, 1e-3, 0.1, InnerOptimizerKind.ADAMW)
    muon = build_inner_optimizer(muon_model, 1e-3, 0.1, InnerOptimizerKind.MUON)
    _steps(model, adamw, batches)
    losses = _steps(muon_model, muon, batches)
    assert all(map(torch.isfinite, map(torch.tensor, losses)))
    matrices = hidden_matrices(muon_model)
    for p in ordered_parameters(muon_model):
        names = moment_names(muon, p)
        assert set(muon.state[p]) == {"step", *(n for n in names if n is not None)}
        assert names == (("momentum_buffer", None) if id(p) in matrices else ("exp_avg", "exp_avg_sq"))
    matrix_numel = sum(p.numel() for p in ordered_parameters(muon_model) if id(p) in matrices)
    adamw_bytes = state_bytes(adamw, ordered_parameters(model))
    muon_bytes = state_bytes(muon, ordered_parameters(muon_model))
    assert adamw_bytes - muon_bytes == 4 * matrix_numel  # one fp32 buffer fewer per matrix weight
    # and it moved the weights otherwise than AdamW did
    assert not torch.equal(next(iter(model.parameters())), next(iter(muon_model.parameters())))


@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
def test_muon_steps_as_torchs_muon_bit_for_bit_on_one_device(tall):
    """dtnode's Muon (muon.py) iterating in bf16, as it does where the device multiplies bf16
    natively, differs from torch's on a --shard host only: three steps of each on the same
    matrix and gradients land on the same bits, momentum included."""
    g = torch.Generator().manual_seed(1)
    shape = (24, 8) if tall else (8, 24)
    start = torch.randn(shape, generator=g)
    grads = [torch.randn(shape, generator=g) for _ in range(3)]
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    options = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "adjust_lr_fn": "match_rms_adamw"}
    mine, torchs = Muon([ours], **options), torch.optim.Muon([theirs], **options)
    mine.iteration_dtype = torch.bfloat16
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        torchs.step()
    assert not torch.equal(theirs.detach(), start)
    assert torch.equal(ours.detach(), theirs.detach())
    assert torch.equal(mine.state[ours]["momentum_buffer"], torchs.state[theirs]["momentum_buffer"])


def test_muon_iterates_in_fp32_where_bf16_is_emulated_and_lands_near_the_bf16_step(monkeypatch):
    """Without bf16 matrix units (an AVX2-only CPU) the Newton-Schulz iterations run in fp32
    (muon.py: 11-68x faster there): the orthogonalised update is the bf16 one within bf16's
    rounding. Which the host has is read from torch's probes."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    muon_module.native_bf16.cache_clear()
    try:
        assert muon_module.iteration_dtype(torch.device("cpu")) == torch.float32
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
        muon_module.native_bf16.cache_clear()
        assert muon_module.iteration_dtype(torch.device("cpu")) == torch.bfloat16
    finally:
        muon_module.native_bf16.cache_clear()
    update = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    coefficients, steps, eps = (3.4445, -4.7750, 2.0315), 5, 1e-7
    fp32 = muon_module.orthogonalized(update, coefficients, steps, eps, torch.float32)
    bf16 = muon_module.orthogonalized(update, coefficients, steps, eps, torch.bfloat16)
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert float((fp32 - bf16.float()).norm() / fp32.norm()) < 0.02
    # and a whole optimizer step takes it: the step lands near the bf16 one
    start = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    for param, dtype in zip(params, (torch.float32, torch.bfloat16), strict=True):
        optimizer = Muon([param], lr=0.02, adjust_lr_fn="match_rms_adamw")
        optimizer.iteration_dtype = dtype
        param.grad = update.clone()
        optimizer.step()
    moved = [p.detach() - start for p in params]
    assert float((moved[0] - moved[1]).norm() / moved[1].norm()) < 0.02


@pytest.mark.parametrize("kind", list(InnerOptimizerKind))
def test_the_inner_state_through_flat_moments_and_a_local_checkpoint_resumes_bit_for_bit(tmp_path, kind):
    """A node that writes its local checkpoint and a node that restarts from it take the same
    next steps, bit for bit: the moments (Muon's momentum among them) and the step count come back."""
    model, description = build_model("tiny", 0)
    optimizer = build_inner_optimizer(model, 1e-3, 0.1, kind)
    _steps(model, optimizer, _batches(3, 256))
    flat = FlatParameters(model.named_parameters())
    first, second, steps = flat_moments(optimizer, ordered_parameters(model), flat.numel)
    assert steps == 3
    layout = Layout(tuple(flat.names), tuple(flat.shapes), outer_momentum=False)
    local = LocalState(first, second, torch.zeros(8, dtype=torch.uint8), 30, steps, 3, 12, None, kind.value)
    write_checkpoint(tmp_path, 1, layout, TrainingState(flat.buffer.clone(), torch.empty(0), local), _meta(description))
    read = read_local_state(tmp_path, 1, layout, "run", config_hash(description))
    assert read.inner_optimizer == kind.value and read.adam_steps == 3
    restarted = copy.deepcopy(model)
    fresh = build_inner_optimizer(restarted, 1e-3, 0.1, kind)
    install_inner_state(fresh, restarted, read.exp_avg, read.exp_avg_sq, read.adam_steps)
    more = _batches(2, 256, seed=1)
    assert _steps(model, optimizer, more) == _steps(restarted, fresh, more)
    for a, b in zip(model.parameters(), restarted.parameters(), strict=True):
        assert torch.equal(a, b)
    if kind is InnerOptimizerKind.MUON:  # the matrices' second moments are the file's zeros
        matrices = hidden_matrices(model)
        offset = 0
        for p in ordered_parameters(model):
            if id(p) in matrices:
                assert not read.exp_avg_sq[offset : offset + p.numel()].any()
                assert read.exp_avg[offset : offset + p.numel()].any()
            offset += p.numel()


def test_a_local_state_names_its_optimizer_and_an_unknown_one_is_refused(tmp_path):
    model, description = build_model("tiny", 0)
    flat = FlatParameters(model.named_parameters())
    layout = Layout(tuple(flat.names), tuple(flat.shapes), outer_momentum=False)
    zeros = torch.zeros(flat.numel)
    local = LocalState(zeros, zeros, torch.zeros(8, dtype=torch.uint8), 0, 0, 0, 0, None, "lion")
    write_checkpoint(tmp_path, 1, layout, TrainingState(flat.buffer.clone(), torch.empty(0), local), _meta(description))
    with pytest.raises(CheckpointError, match="inner_optimizer 'lion' is none of adamw, muon"):
        read_local_state(tmp_path, 1, layout, "run", config_hash(description))


@pytest.mark.parametrize(("saved", "now"), [("muon", "adamw"), ("adamw", "muon")])
def test_a_node_resuming_from_another_optimizers_state_starts_its_inner_state_fresh(tmp_path, saved, now):
    """A local file of Muon's moments read by an AdamW node would divide a momentum by the
    zeros Muon keeps for the second moment (steps of about lr x 1e8): a node resumed under
    another --inner-optimizer keeps θ_g, its inner step and data position, and starts the
    inner optimizer fresh (with its warmup); the same optimizer resumes its moments."""
    settings = NodeSettings(
        state_dir=tmp_path, model="tiny", batch_size=2, seq_len=16, device="cpu", inner_optimizer=now
    )
    worker = ModelWorker(settings, build_workload(settings, tmp_path), torch.device("cpu"))
    try:
        worker.build("peer")
        flat = worker.trainer.flat
        state = TrainingState(worker.replica.theta_g.clone(), torch.zeros(flat.numel))
        ones = torch.ones(flat.numel)
        for kind, steps in ((saved, 0), (now, 7)):
            local = LocalState(ones, ones, torch.zeros(8, dtype=torch.uint8), 70, 7, 0, 0, None, kind)
            worker.install(LoadedCheckpoint(3, state, {}), local)
            assert worker.trainer.inner_step == 70 and worker.trainer.adam_steps == steps
            first, _, count = worker.trainer.inner_state()
            assert count == steps and bool(first.any()) == (steps > 0)
    finally:
        worker.shutdown()
