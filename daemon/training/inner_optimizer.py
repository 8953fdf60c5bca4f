"""The inner optimizer a swarm trains with (`--inner-optimizer`): AdamW on every parameter, or
Muon on the hidden weight matrices and AdamW on the rest, MuLoCo's inner loop.

Muon orthogonalises each matrix's momentum (Newton-Schulz) before the step, which suits the
matrices of a transformer's blocks; embeddings, the output layer, gains and biases are not such
operators, so AdamW keeps them, as torch's own guidance and the MuLoCo paper do. Muon's rate is
matched to AdamW's RMS (torch's `match_rms_adamw`), so one `--inner-lr` and one weight decay
serve both halves, and the schedule sets one rate on every group.

The two halves are one `torch.optim.Optimizer`: one list of parameter groups (the schedule,
the gradient clip and fp16's loss scaler walk it), one state map keyed by parameter (the
checkpoint code reads moments through `moment_names`, whichever half holds a parameter), one
step. Muon's state is its momentum only: a host holds 4 bytes of state per matrix weight
instead of AdamW's 8.

On a `--shard` host the matrices are DTensor shards: Muon (muon.py) gathers each matrix's
update once, every rank orthogonalises it whole and keeps its own rows, equal to a single
device's result up to bf16 rounding, in which the iterations run on any device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from dtnode.daemon.config.training_options import InnerOptimizerKind
from dtnode.daemon.training.muon import Muon

ADAMW_BETAS = (0.9, 0.95)  # β2 = 0.95, as is usual for transformers
MUON_MOMENTUM = 0.95  # torch's default and MuLoCo's inner setting
ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")
MUON_MOMENTS = ("momentum_buffer", None)


def build_inner_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, kind: InnerOptimizerKind | str = InnerOptimizerKind.ADAMW
) -> torch.optim.Optimizer:
    """DiLoCo's inner optimizer (also the data-parallel baseline's in the convergence
    benchmark): trainable parameters only, no decay on gains and biases, AdamW's fused CUDA
    kernel on a GPU; with `muon`, Muon takes the hidden matrices."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if InnerOptimizerKind(kind) is InnerOptimizerKind.MUON:
        matrices = hidden_matrices(model)
        taken = [p for p in trainable if id(p) in matrices]
        if taken:  # a model without hidden matrices has nothing for Muon
            return MuonWithAdamW(taken, [p for p in trainable if id(p) not in matrices], lr, weight_decay)
    return _adamw(trainable, lr, weight_decay)


def _adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    on_cuda = bool(params) and params[0].device.type == "cuda"
    kernel = {"fused": True} if on_cuda else {}
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=ADAMW_BETAS,
        **kernel,
    )


def hidden_matrices(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters Muon takes: trainable 2-D weights that are neither an
    embedding table nor the output layer (a tied output layer is the embedding's weight; an
    untied one is found through `get_output_embeddings`, which every HF language model has)."""
    excluded: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            excluded.add(id(module.weight))
        output_of: Callable[[], torch.nn.Module | None] | None = getattr(module, "get_output_embeddings", None)
        if callable(output_of):
            head = output_of()
            if head is not None and getattr(head, "weight", None) is not None:
                excluded.add(id(head.weight))
    return {id(p) for p in model.parameters() if p.requires_grad and p.dim() == 2 and id(p) not in excluded}


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on `matrices`, AdamW on `rest`, as one optimizer (see the module's docstring)."""

    def __init__(
        self, matrices: list[torch.nn.Parameter], rest: list[torch.nn.Parameter], lr: float, weight_decay: float
    ) -> None:
        self.muon = Muon(
            matrices,
            lr=lr,
            weight_decay=weight_decay,
            momentum=MUON_MOMENTUM,
            nesterov=True,
            adjust_lr_fn="match_rms_adamw",
        )
        self.adamw = _adamw(rest, lr, weight_decay)
        self.matrices = frozenset(id(p) for p in matrices)
        # the halves' groups are these very dicts: a rate set here is the rate they step with
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {"lr": lr})
        self.muon.state = self.adamw.state = self.state  # one map, keyed by parameter
        self.defaults.update(self.adamw.defaults)  # the fused kernel's flag, which step_count reads

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Both halves' steps; Muon's parameters count their steps too (its own state keeps
        none), so a checkpoint's step count does not depend on which half it is read from."""
        self.muon.step()
        self.adamw.step()
        for group in self.muon.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state is not None and "momentum_buffer" in state:
                    state["step"] = int(state.get("step", 0)) + 1
        return None

    def moment_names(self, param: torch.Tensor) -> tuple[str, str | None]:
        return MUON_MOMENTS if id(param) in self.matrices else ADAMW_MOMENTS


def moment_names(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[str, str | None]:
    """The state entries that hold `param`'s first and second moment: AdamW's exp_avg and
    exp_avg_sq, or Muon's momentum buffer and none (a checkpoint keeps zeros in its place)."""
    if isinstance(optimizer, MuonWithAdamW):
        return optimizer.moment_names(param)
    return ADAMW_MOMENTS


def state_bytes(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> int:
    """Bytes of moment tensors the optimizer holds for `params` (what `--inner-optimizer`
    changes in a host's memory)."""
    total = 0
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                total += value.numel() * value.element_size()
    return total
