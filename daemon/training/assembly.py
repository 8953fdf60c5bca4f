"""The model side of a node put together from its settings: the data stream, the local ranks
(DDP or --shard), the inner schedule, the trainer (θ_l and the inner optimizer), the replica
(θ_g and the outer optimizer, coded in host memory with int8 on a CPU) and the error-feedback
buffer. Runs on the training thread (`ModelWorker.build`); a combination the settings allow
but the hardware cannot run is a SettingsError naming the option.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtnode.daemon.config.settings import NodeSettings, SettingsError
from dtnode.daemon.training.coded_replica import CodedReplica
from dtnode.daemon.training.outer_replica import Replica
from dtnode.daemon.training.precision import Precision
from dtnode.daemon.training.ranks.host import LocalRankFailure, LocalRanks, plan_ranks
from dtnode.daemon.training.schedule import LearningRateSchedule
from dtnode.daemon.training.trainer import Trainer
from dtnode.daemon.workload.build import Workload
from dtnode.daemon.workload.data import DataStream


@dataclass
class ModelParts:
    trainer: Trainer
    replica: Replica
    # error feedback: what the wire code did not carry yet (int8 when enabled; sparse always)
    residual: torch.Tensor | None


def assemble(settings: NodeSettings, workload: Workload, device: torch.device, peer_id: str) -> ModelParts:
    """The trainer, the replica and the feedback buffer the settings name, on `device`."""
    s, w = settings, workload
    plan = plan_ranks(s)
    if plan.threads is not None:
        torch.set_num_threads(plan.threads)
    # one stream for the node: each step's batch holds every rank's rows, so the data
    # position is the node's whatever its rank count
    rows = s.hardware.batch_size * plan.world_size
    stream = DataStream(w.sources, s.swarm.run_id, peer_id, rows, w.seq_len, s.evaluation.eval_sequences)
    precision = Precision(s.hardware.precision)
    if s.hardware.shard and plan.world_size > 1 and precision.resolve(device) == Precision.FP16:
        raise SettingsError(
            "--precision",
            f"fp16{' (what auto means on this GPU, which has no bf16)' if precision == Precision.AUTO else ''} "
            "does not combine with --shard (its loss scale is per rank); use --precision fp32",
        )
    ranks = LocalRanks(plan, s) if plan.world_size > 1 else None
    if ranks is not None:
        try:
            ranks.start()
        except LocalRankFailure as e:
            option = "--gpus" if plan.backend == "nccl" else "--nproc-per-node"
            raise SettingsError(option, str(e)) from None
    schedule = LearningRateSchedule(
        s.inner.inner_lr, s.inner.warmup_steps, s.inner.total_steps, s.inner.lr_schedule, s.inner.min_lr_ratio
    )
    trainer = Trainer(
        w.model,
        stream,
        device,
        schedule=schedule,
        weight_decay=s.inner.inner_weight_decay,
        optimizer_kind=s.inner.inner_optimizer,
        grad_clip=s.inner.grad_clip,
        compile=s.hardware.compile,
        ranks=ranks,
        precision=precision,
    )
    replica: Replica
    if s.wire.compression == "int8" and trainer.local_weights.span_device.type == "cpu":  # θ_g in host memory
        replica = CodedReplica(trainer, s.diloco.outer_lr, s.diloco.outer_momentum, s.wire.wire_format().block_size)
    else:
        replica = Replica(trainer, s.diloco.outer_lr, s.diloco.outer_momentum)
    residual = None
    if (s.wire.error_feedback and s.wire.compression == "int8") or s.wire.compression == "sparse":
        residual = torch.zeros(replica.numel, dtype=torch.float32)
        if isinstance(replica, CodedReplica):  # the rounding error arises as Δ is coded
            replica.feedback = residual
    return ModelParts(trainer, replica, residual)
