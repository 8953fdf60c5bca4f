"""A child training rank of a multi-rank host (`python -m dtnode.daemon.training.ranks.child`).

It holds a DDP replica of the model and does what rank 0 (the node process) says, one command
at a time (see training/ranks/host.py): an inner step on the rows it is sent, θ_l or the AdamW state
from rank 0. It has no network, no data and no state of its own: everything it holds comes
from rank 0, so killing it loses nothing, and the node restarts it from its θ_g.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from dtnode.daemon.training.inner_optimizer import build_inner_optimizer
from dtnode.daemon.training.inner_state import install_inner_state, ordered_parameters
from dtnode.daemon.training.inner_step import held_out_loss, inner_step, learned_buffers
from dtnode.daemon.training.precision import Precision, StepPrecision
from dtnode.daemon.training.ranks.ddp import ddp_replica
from dtnode.daemon.training.ranks.fsdp import (
    gather_moments,
    gather_params,
    scatter_moments,
    scatter_params,
    shard_model,
    shared_eval_set,
)
from dtnode.daemon.training.ranks.host import (
    CONTROL_TIMEOUT,
    OOM_EXIT,
    SPEC_ENV,
    Command,
    RankSpec,
    die_with_parent,
    out_of_memory_line,
    own_memory,
)
from dtnode.daemon.workload.model import build_model
from dtnode.ops.flat import FlatParameters, flat_names

log = logging.getLogger("dtnode")


class ChildRank:
    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        dist.init_process_group(
            spec.backend,
            init_method=f"tcp://127.0.0.1:{spec.port}",
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout_s),
            device_id=self.device if spec.backend == "nccl" else None,
        )
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        model, _ = build_model(spec.model, 0)  # its weights come from rank 0 (DDP's wrap, or PARAMS)
        names = flat_names(model.named_parameters(), learned_buffers(model))  # rank 0's order of θ_l
        self.model = model.to(self.device)
        wrapped: torch.nn.Module
        if spec.shard:
            wrapped = shard_model(self.model)
        else:
            self.flat = FlatParameters(self.model.named_parameters(), learned_buffers(self.model))
            wrapped = ddp_replica(self.model, self.device)
        found = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        self.synced = [found[name] for name in names]
        self.forward_model: Callable[[torch.Tensor], torch.Tensor] = torch.compile(wrapped) if spec.compile else wrapped
        self.optimizer = build_inner_optimizer(self.model, 0.0, spec.weight_decay, spec.inner_optimizer)
        self.precision = StepPrecision(Precision(spec.precision), self.device)
        self.trainable = ordered_parameters(self.model)

    def serve(self) -> None:
        """Commands until rank 0 goes away (its socket closes) or kills this process."""
        header = torch.zeros(4, dtype=torch.float64)
        while True:
            dist.broadcast(header, 0, group=self.control)
            command = Command(int(header[0]))
            if command is Command.STEP:
                self._step(float(header[1]), int(header[2]), int(header[3]))
            elif command is Command.PARAMS and self.spec.shard:
                scatter_params(self.synced, None, self.device)
            elif command is Command.PARAMS:
                dist.broadcast(self.flat.buffer, 0)
            elif command is Command.INNER and self.spec.shard:
                scatter_moments(self.optimizer, self.trainable, None, int(header[1]), self.device)
            elif command is Command.INNER:
                self._inner(int(header[1]))
            elif command is Command.ADD:
                scatter_params(self.synced, None, self.device, add=True)
            elif command is Command.GATHER:
                gather_params(self.synced, None)
            elif command is Command.GATHER_INNER:
                gather_moments(self.optimizer, self.trainable, None)
            elif command is Command.EVAL:
                tokens = shared_eval_set(None, (int(header[1]), int(header[2])), self.control)
                held_out_loss(self.model, tokens, self.device, self.precision.precision)

    def _step(self, lr: float, rows: int, width: int) -> None:
        started = time.monotonic()
        batch = torch.empty(rows, width, dtype=torch.long)
        dist.scatter(batch, None, src=0, group=self.control)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        try:
            loss = inner_step(
                self.forward_model,
                self.optimizer,
                batch,
                self.device,
                self.spec.grad_clip,
                self.trainable,
                precision=self.precision,
            )
        except torch.cuda.OutOfMemoryError as e:
            report_out_of_memory(self.spec, e)
        report = torch.tensor([loss, time.monotonic() - started, *own_memory(self.device)], dtype=torch.float64)
        dist.gather(report, None, dst=0, group=self.control)

    def _inner(self, steps: int) -> None:
        """Rank 0's AdamW moments, received where its backend sends them (the GPU over NCCL)."""
        where = self.device if self.spec.backend == "nccl" else torch.device("cpu")
        moments = [torch.zeros(self.flat.numel, device=where) for _ in range(2)]  # (DDP: self.flat exists)
        if steps > 0:
            for buffer in moments:
                dist.broadcast(buffer, 0)
        install_inner_state(self.optimizer, self.model, moments[0], moments[1], steps)


def report_out_of_memory(spec: RankSpec, e: torch.cuda.OutOfMemoryError) -> None:
    """One line for rank 0 to show (on this process's stdout, a pipe to it), then exit."""
    print(out_of_memory_line(spec.rank, spec.device, e), flush=True)
    os._exit(OOM_EXIT)


def main() -> None:
    spec = RankSpec.model_validate_json(os.environ[SPEC_ENV])
    die_with_parent(spec.parent_pid)
    # Ctrl-C reaches the whole process group and systemd signals the whole cgroup: the node
    # stops its round first, then kills this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {spec.rank} %(levelname)s %(message)s")
    try:
        rank = ChildRank(spec)
    except torch.cuda.OutOfMemoryError as e:
        report_out_of_memory(spec, e)
    try:
        rank.serve()
    except RuntimeError as e:  # rank 0 went away (it stopped, or restarts its ranks): nothing to save
        log.debug("rank 0 is gone (%s)", e)
        sys.exit(0)


if __name__ == "__main__":
    main()
