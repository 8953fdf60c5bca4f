"""`--precision`: bf16 and fp16 autocast of the inner steps, fp16 with its loss scale, on CPU
(the CUDA paths take the same code with device type "cuda"; see tests/test_cuda.py)."""

import pytest
import torch

from dtnode.daemon.config.settings import NodeSettings, SettingsError
from dtnode.daemon.config.training_options import InnerOptimizerKind
from dtnode.daemon.training.inner_optimizer import build_inner_optimizer
from dtnode.daemon.training.inner_step import inner_step, next_token_loss
from dtnode.daemon.training.precision import Precision, StepPrecision
from dtnode.daemon.training.worker import ModelWorker
from dtnode.daemon.workload.build import build_workload
from dtnode.daemon.workload.model import build_model

CPU = torch.device("cpu")


def _tiny(kind: InnerOptimizerKind = InnerOptimizerKind.ADAMW):
    model, _ = build_model("tiny", 0)
    batch = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    return model, build_inner_optimizer(model, 1e-3, 0.1, kind), batch


def test_auto_is_fp32_on_a_cpu_and_a_choice_is_kept():
    assert Precision.AUTO.resolve(CPU) == Precision.FP32
    assert Precision.FP16.resolve(CPU) == Precision.FP16 and Precision.BF16.autocast_dtype == torch.bfloat16
    assert NodeSettings(precision="fp16").hardware.precision == "fp16"
    with pytest.raises(ValueError, match="'auto', 'bf16', 'fp16' or 'fp32'"):
        NodeSettings(precision="fp8")


@pytest.mark.parametrize("kind", list(InnerOptimizerKind))
@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16])
def test_a_half_precision_step_trains_the_fp32_weights_like_an_fp32_step(precision, kind):
    """The weights stay fp32; the step's loss is the fp32 one within half precision's error,
    and the step moves the weights in the same direction (fp16's loss scaler steps Muon's
    half and AdamW's alike)."""
    model, optimizer, batch = _tiny(kind)
    reference, ref_optimizer, _ = _tiny(kind)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    step = StepPrecision(precision, CPU)
    loss = inner_step(model, optimizer, batch, CPU, 1.0, list(model.parameters()), precision=step)
    ref_loss = inner_step(reference, ref_optimizer, batch, CPU, 1.0, list(reference.parameters()))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert loss == pytest.approx(ref_loss, rel=0.02)
    moved = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
    ref_moved = torch.cat([p.detach().flatten() for p in reference.parameters()]) - before
    cosine = torch.nn.functional.cosine_similarity(moved, ref_moved, dim=0)
    assert cosine > 0.9, cosine
    assert (step.scaler is not None) == (precision == Precision.FP16)


@pytest.mark.parametrize("kind", list(InnerOptimizerKind))
def test_fp16_skips_a_step_whose_gradients_overflow_and_lowers_its_scale(kind):
    model, optimizer, batch = _tiny(kind)
    step = StepPrecision(Precision.FP16, CPU)
    # scaled gradients overflow fp16; each overflow divides the scale by 256 (not 2, the default:
    # the same path in a few steps instead of some forty, each slow in fp16 on a CPU)
    step.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-8)
    before = [p.detach().clone() for p in model.parameters()]
    inner_step(model, optimizer, batch, CPU, 1.0, list(model.parameters()), precision=step)
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
    assert step.scaler.get_scale() < 2.0**40
    for _ in range(8):  # the scale falls until the gradients fit, then the steps count again
        inner_step(model, optimizer, batch, CPU, 1.0, list(model.parameters()), precision=step)
    assert not all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))


def test_a_forward_pass_runs_under_the_chosen_autocast():
    model, _, batch = _tiny()
    seen: list[torch.dtype] = []
    model.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    next_token_loss(model, batch, CPU, Precision.BF16)
    next_token_loss(model, batch, CPU, Precision.FP32)
    assert seen == [torch.bfloat16, torch.float32]


def test_fp16_with_shard_is_refused_naming_the_option(tmp_path):
    settings = NodeSettings(
        state_dir=tmp_path, device="cpu", nproc_per_node=2, shard=True, precision="fp16", threads_per_rank=1
    )
    worker = ModelWorker(settings, build_workload(settings, tmp_path), CPU)
    with pytest.raises(SettingsError, match="--precision: fp16 does not combine with --shard"):
        worker.build("peer")
