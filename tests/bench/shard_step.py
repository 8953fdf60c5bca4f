"""The inner step of a `--shard` host (FSDP2 ranks over gloo on this CPU) with each inner
optimizer, side by side: what Muon's whole-matrix iterations cost a sharded host beside AdamW
(issue 59).

    .venv/bin/python -m tests.bench.shard_step --model tiny --ranks 2 --steps 8

A real ModelWorker with its child ranks, one thread a rank; the first two steps (FSDP2's
first gathers, the optimizer's state) are not timed."""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch

from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.config.training_options import InnerOptimizerKind
from dtnode.daemon.training.worker import ModelWorker
from dtnode.daemon.workload.build import build_workload


def step_ms(model: str, kind: InnerOptimizerKind, ranks: int, steps: int, batch: int, seq_len: int) -> float:
    """Milliseconds per inner step of a `ranks`-rank --shard host, after two untimed steps."""
    state_dir = Path(tempfile.mkdtemp(prefix="dtnode-shard-bench-"))
    settings = NodeSettings(
        inner_optimizer=kind,
        shard=True,
        eval_sequences=8,
        state_dir=state_dir,
        model=model,
        batch_size=batch,
        seq_len=seq_len,
        fused_kernels=False,
        device="cpu",
        nproc_per_node=ranks,
        threads_per_rank=1,
    )
    worker = ModelWorker(settings, build_workload(settings, state_dir), torch.device("cpu"))
    try:
        worker.build("bench")
        worker.trainer.run(2, threading.Event())
        started = time.perf_counter()
        worker.trainer.run(steps, threading.Event())
        return (time.perf_counter() - started) / steps * 1e3
    finally:
        worker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks of the sharded host")
    parser.add_argument("--steps", type=int, default=8, help="timed inner steps per optimizer")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    args = parser.parse_args()
    print(f"{args.model}, {args.ranks}-rank --shard host on cpu (gloo), batch {args.batch_size} a rank")
    for kind in InnerOptimizerKind:
        ms = step_ms(args.model, kind, args.ranks, args.steps, args.batch_size, args.seq_len)
        print(f"  {kind.value:6s} {ms:8.1f} ms/step")


if __name__ == "__main__":
    main()
