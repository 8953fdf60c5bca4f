"""`--shard`: the model's weights, gradients and AdamW state split over a host's local ranks
with FSDP2 (`fully_shard`), for models that do not fit one device.

Every function here is a collective: every local rank calls it, in the same order, with the
same parameters (rank 0 passes the data, the others None). θ_l lives in the shards only. Rank 0
reads it (`gather_params`) and writes it (`scatter_params`) one parameter at a time, as the
replica's span-wise work asks (training/theta_local.py): Δ = θ_g − θ_l into the staging buffer
(int8 codes with the int8 codec, coded as each parameter comes: see training/outer_replica.py), θ_l ← θ_g
after the outer step. So rank 0 holds θ_g, the momentum and Δ in host memory, and of θ_l one
parameter at a time, not a copy of the model (4 bytes per parameter less than a host copy of
θ_l would take). A shard is rows of a parameter along its first
dimension, as `torch.chunk` cuts them: what FSDP2 keeps on each rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dtnode.daemon.training.inner_optimizer import moment_names
from dtnode.daemon.training.inner_state import moment_state
from dtnode.daemon.training.ranks.host import Command, FlatMoments, LocalRankFailure, LocalRanks
from dtnode.daemon.training.theta_local import SpanWork
from dtnode.ops.flat import FlatParameters


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over the model: each element of its block lists (a transformer's layers) one unit,
    the rest in the root's. Returns the model (now an FSDP module, called as before)."""
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                fully_shard(block)
    fully_shard(model)
    return model


def own_rows(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a full tensor, as FSDP2 cuts them for the parameter `like`."""
    if not isinstance(like, DTensor):
        return full
    chunks = full.chunk(dist.get_world_size(), dim=0)
    rank = dist.get_rank()
    return chunks[rank] if rank < len(chunks) else full[:0]


def _as_local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# rank 0's side of a parameter-wise read or write: (index, full values) for each parameter
ParamWork = Callable[[int, torch.Tensor], object]


@torch.no_grad()
def scatter_params(
    params: Sequence[torch.Tensor], fill: ParamWork | None, device: torch.device, add: bool = False
) -> None:
    """Rank 0's full values of each parameter (`fill(i, full)` writes them) into every rank's
    shards, or added to them (`add`)."""
    for i, param in enumerate(params):
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        if fill is not None:
            fill(i, full)
        dist.broadcast(full, 0)
        rows = own_rows(full, param)
        if add:
            _as_local(param).add_(rows)
        else:
            _as_local(param).copy_(rows)


@torch.no_grad()
def gather_params(params: Sequence[torch.Tensor], take: ParamWork | None) -> None:
    """Every rank's shards of each parameter, whole on rank 0 (`take(i, full)`), one at a time."""
    for i, param in enumerate(params):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if take is not None:
            take(i, full)


@torch.no_grad()
def scatter_moments(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    moments: tuple[list[torch.Tensor], list[torch.Tensor]] | None,
    steps: int,
    device: torch.device,
) -> None:
    """Rank 0's optimizer moments (full, per parameter) into every rank's optimizer state, as
    shards like the parameters'; steps 0 clears the state everywhere."""
    optimizer.state.clear()
    if steps <= 0:
        return
    for i, param in enumerate(params):
        shards: list[torch.Tensor] = []
        for which in (0, 1):
            full = torch.empty(param.shape, dtype=torch.float32, device=device)
            if moments is not None:
                full.copy_(moments[which][i])
            dist.broadcast(full, 0)
            rows = own_rows(full, param).clone()
            if isinstance(param, DTensor):
                shards.append(
                    DTensor.from_local(
                        rows, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                    )
                )
            else:
                shards.append(rows)
        optimizer.state[param] = moment_state(optimizer, param, steps, device, shards[0], shards[1])


@torch.no_grad()
def gather_moments(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], into: tuple[torch.Tensor, torch.Tensor] | None
) -> int:
    """Every rank's optimizer moments into rank 0's flat buffers (`into`, parameter order; zeros
    where Muon keeps no second moment); the step count."""
    steps, offset = 0, 0
    for param in params:
        state = optimizer.state.get(param)
        n = param.numel()
        names = moment_names(optimizer, param)
        if state and names[0] in state:
            for which, name in enumerate(names):
                if name is None:
                    continue
                value = state[name]
                full = value.full_tensor() if isinstance(value, DTensor) else value
                if into is not None:
                    into[which][offset : offset + n] = full.reshape(-1).float().cpu()
            steps = max(steps, int(state.get("step", 0)))
        offset += n
    return steps


def shared_eval_set(eval_set: torch.Tensor | None, shape: tuple[int, int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rank 0's eval set on every rank: a sharded model's forward passes are collectives, so
    every rank runs them, on the same tokens (over the gloo control `group`: CPU tensors)."""
    tokens = eval_set.contiguous() if eval_set is not None else torch.empty(shape, dtype=torch.long)
    dist.broadcast(tokens, 0, group=group)
    return tokens


class HostShards:
    """Rank 0's side of a sharded host: θ_l span by span (one span per parameter, see
    training/theta_local.py) and the AdamW state, through commands to the ranks."""

    def __init__(self, ranks: LocalRanks, flat: FlatParameters, model: torch.nn.Module, device: torch.device):
        self.ranks, self.flat, self.device = ranks, flat, device
        self.numel = flat.numel
        self.span_device = torch.device("cpu")  # θ_l's spans are handed over in host memory, beside θ_g
        shard_model(model)
        found = dict(model.named_parameters()) | dict(model.named_buffers())
        self.synced = [found[name] for name in flat.names]  # the flat layout's tensors, sharded or not
        self.params = [p for _, p in model.named_parameters() if p.requires_grad]
        self.spans = [slice(off, off + t.numel()) for off, t in zip(flat.offsets, self.synced, strict=True)]
        # θ_l's first values (the model as built), until they reach the shards: then the buffer goes
        self.initial: torch.Tensor | None = flat.buffer
        self.pending_inner: FlatMoments | None = None  # loaded, not yet sent
        self.evaluates_together = True  # a forward pass gathers each unit's weights from every rank

    def load_inner(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, moments: FlatMoments) -> None:
        self.pending_inner = moments  # every rank takes its shard of them before the next step

    def read(self, work: SpanWork) -> None:
        """θ_l parameter by parameter, gathered from the shards into host memory. With the ranks
        down (a rank failed: the node is on its way out, to restart whole) θ_l is lost with the
        shards: LocalRankFailure. θ_g, which the outer step and the final checkpoint need, never
        lived in them."""
        if self.initial is not None:
            work(slice(0, self.numel), self.initial)
            return
        if not self.ranks.running:
            raise LocalRankFailure("the local ranks are down: θ_l's shards are lost")

        def take(i: int, full: torch.Tensor) -> None:
            work(self.spans[i], full.detach().reshape(-1).to("cpu"))

        with self.ranks.collective():
            self.ranks.command(Command.GATHER)
            gather_params(self.synced, take)

    def write(self, work: SpanWork) -> None:
        """θ_l parameter by parameter into the shards, from a host buffer of one parameter. With
        the ranks down there is nowhere to put it: the node restarts from θ_g."""
        self.initial = None
        self.flat.release()
        if not self.ranks.running:
            return
        self._scatter(work, Command.PARAMS)

    def add(self, work: SpanWork) -> None:
        """θ_l += an amount `work` writes parameter by parameter, added by each rank to its
        shards. θ_l's first values, not in the shards yet, take it in host memory."""
        initial = self.initial
        if initial is not None:
            scratch = torch.empty(max(span.stop - span.start for span in self.spans), dtype=torch.float32)
            for span in self.spans:
                amount = scratch[: span.stop - span.start]
                work(span, amount)
                initial[span].add_(amount)
            return
        if not self.ranks.running:
            raise LocalRankFailure("the local ranks are down: θ_l's shards are lost")
        self._scatter(work, Command.ADD)

    def _scatter(self, work: SpanWork, command: Command) -> None:
        """`work`'s values for each parameter, from a host buffer of one parameter to every
        rank, written over its shards (PARAMS) or added to them (ADD)."""
        scratch = torch.empty(max(span.stop - span.start for span in self.spans), dtype=torch.float32)

        def fill(i: int, full: torch.Tensor) -> None:
            host = scratch[: full.numel()]
            work(self.spans[i], host)
            full.copy_(host.view(full.shape))

        with self.ranks.collective():
            self.ranks.command(command)
            scatter_params(self.synced, fill, self.device, add=command is Command.ADD)

    def push_params(self) -> None:
        """θ_l's first values into the shards, if they are not there yet (every later change of
        θ_l goes to them as it is made, `write`)."""
        initial = self.initial
        if initial is not None:
            self.write(lambda span, out: out.copy_(initial[span]))

    def push_inner(self, optimizer: torch.optim.Optimizer) -> None:
        """The AdamW moments loaded last (a resume's, or none) into every rank's shards."""
        exp_avg, exp_avg_sq, steps = self.pending_inner or (torch.empty(0), torch.empty(0), 0)
        per_param = None
        if steps > 0:
            per_param = (self._split(exp_avg), self._split(exp_avg_sq))
        with self.ranks.collective():
            self.ranks.command(Command.INNER, float(steps))
            scatter_moments(optimizer, self.params, per_param, steps, self.device)
        self.pending_inner = None

    def _split(self, flat_values: torch.Tensor) -> list[torch.Tensor]:
        return list(self.flat.views(flat_values).values())[: len(self.params)]

    def gather_inner(self, optimizer: torch.optim.Optimizer) -> FlatMoments:
        """Every rank's AdamW moments, flat in parameter order on the host (a local checkpoint's)."""
        if self.pending_inner is not None:
            return self.pending_inner
        if not self.ranks.running:
            raise LocalRankFailure("the local ranks are down: their AdamW shards are lost")
        exp_avg, exp_avg_sq = torch.zeros(self.flat.numel), torch.zeros(self.flat.numel)
        with self.ranks.collective():
            self.ranks.command(Command.GATHER_INNER)
            steps = gather_moments(optimizer, self.params, (exp_avg, exp_avg_sq))
        return exp_avg, exp_avg_sq, steps

    def eval_tokens(self, eval_set: torch.Tensor) -> torch.Tensor:
        """Start a held-out eval on every rank; the tokens rank 0 evaluates too."""
        with self.ranks.collective():
            self.ranks.command(Command.EVAL, float(eval_set.shape[0]), float(eval_set.shape[1]))
            return shared_eval_set(eval_set, (eval_set.shape[0], eval_set.shape[1]), self.ranks.control)
