"""One inner step and the losses, as every local rank computes them: the optimizer's step on a batch
(forward under the rank's autocast, backward, clip, step), the next-token loss, and the held-out
loss (the optimizer itself is inner_optimizer.py's). `Trainer` (trainer.py) drives them on rank 0, and each
child rank runs the same step on its rows (ranks/child.py).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from dtnode.daemon.training.precision import Precision, StepPrecision

EVAL_CHUNK = 64  # eval sequences per forward pass


def inner_step(
    model: Callable[[torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    device: torch.device,
    grad_clip: float,
    parameters: list[torch.nn.Parameter],
    while_device_runs: Callable[[], None] | None = None,
    precision: StepPrecision | None = None,
) -> float:
    """One inner step on `batch` (every local rank runs this, on its rows); the loss.
    `while_device_runs` is called once the step's kernels are queued, before the loss is
    read back (on a GPU the CPU is otherwise idle until the step ends)."""
    precision = precision or StepPrecision(Precision.AUTO, device)
    loss = next_token_loss(model, batch, device, precision.precision)
    optimizer.zero_grad(set_to_none=True)
    precision.backward_and_step(loss, optimizer, parameters, grad_clip)
    if while_device_runs is not None:
        while_device_runs()
    return loss.detach().item()


def next_token_loss(
    model: Callable[[torch.Tensor], torch.Tensor],
    batch: torch.Tensor,
    device: torch.device,
    precision: Precision = Precision.AUTO,
) -> torch.Tensor:
    """Mean cross-entropy of predicting batch[:, 1:] from batch[:, :-1], the forward pass under
    the autocast of `precision` (auto: bf16 on a GPU that has it, fp16 on one that does not)."""
    batch = batch.to(device, non_blocking=True)
    dtype = precision.resolve(device).autocast_dtype
    with torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext():
        logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def held_out_loss(
    model: torch.nn.Module, eval_set: torch.Tensor, device: torch.device, precision: Precision = Precision.AUTO
) -> float:
    """Mean loss over an eval set, in chunks; the node's eval loss and the benchmarks' alike."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for chunk in eval_set.split(EVAL_CHUNK):
        total += float(next_token_loss(model, chunk, device, precision)) * len(chunk)
        count += len(chunk)
    model.train(was_training)
    return total / count


def learned_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Persistent floating-point buffers (a norm's running statistics): they ride in the flat
    buffer, so they are averaged and checkpointed with θ. A constant one has Δ = 0 and stays
    put; non-persistent buffers (rotary caches) are rebuilt from the config and left alone."""
    found, seen = [], set()
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if (
                buffer is None
                or not buffer.is_floating_point()
                or name in module._non_persistent_buffers_set
                or id(buffer) in seen
            ):
                continue
            seen.add(id(buffer))
            found.append((f"{module_name}.{name}" if module_name else name, buffer))
    return found
