"""What `--inner-optimizer muon` costs a host beside AdamW (issue 59): the optimizer state it
holds and the time of one inner step, both optimizers side by side on the same model, batch and
device.

    .venv/bin/python -m tests.bench.inner_optimizer --models tiny,small --steps 6

State is counted from the optimizer's tensors after the first step (Muon keeps one momentum
buffer per hidden matrix, AdamW two moments per weight); the step time is the median of the
steps after the first (which builds the state). A second table times Muon's Newton-Schulz
iterations on each shape of hidden matrix in bf16 (torch's Muon) and in fp32 side by side, and
says which one this device's Muon takes (daemon/training/muon.py `iteration_dtype`).
`--no-iterations` leaves it out (bf16 without bf16 units takes seconds a matrix)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch

from dtnode.daemon.config.training_options import InnerOptimizerKind
from dtnode.daemon.training.inner_optimizer import build_inner_optimizer, hidden_matrices, state_bytes
from dtnode.daemon.training.inner_state import ordered_parameters
from dtnode.daemon.training.inner_step import inner_step
from dtnode.daemon.training.muon import iteration_dtype, orthogonalized
from dtnode.daemon.workload.model import build_model


def measure(spec: str, kind: InnerOptimizerKind, steps: int, batch: int, seq_len: int, device: torch.device) -> dict:
    model, _ = build_model(spec, 0)
    model = model.to(device)
    optimizer = build_inner_optimizer(model, 1e-3, 0.1, kind)
    params = ordered_parameters(model)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (batch, seq_len + 1), generator=g)
        started = time.perf_counter()
        inner_step(model, optimizer, tokens, device, 1.0, params)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    numel = sum(p.numel() for p in params)
    matrices = sum(p.numel() for p in params if id(p) in hidden_matrices(model))
    return {
        "params": numel,
        "matrix_share": matrices / numel,
        "state_mb": state_bytes(optimizer, params) / 1e6,
        "state_b_per_param": state_bytes(optimizer, params) / numel,
        "step_ms": 1000 * statistics.median(times[1:]),
    }


# torch's Muon's defaults (ns_coefficients, ns_steps, eps)
NEWTON_SCHULZ = ((3.4445, -4.7750, 2.0315), 5, 1e-7)


def iteration_ms(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> float:
    """Milliseconds of one orthogonalisation of a random matrix of `shape` in `dtype` (the median
    of three after one untimed)."""
    update = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for _ in range(4):
        started = time.perf_counter()
        orthogonalized(update, *NEWTON_SCHULZ, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[1:])


def print_iterations(specs: list[str], device: torch.device) -> None:
    print(f"Newton-Schulz iterations on {device}; this device's Muon takes {iteration_dtype(device)}")
    print(f"{'model':>7} {'matrix':>11} {'count':>5} {'bf16 ms':>9} {'fp32 ms':>9} {'bf16/fp32':>9}")
    for spec in specs:
        model, _ = build_model(spec, 0)
        hidden = hidden_matrices(model)
        shapes = Counter(tuple(p.shape) for p in model.parameters() if id(p) in hidden)
        for shape, count in sorted(shapes.items()):
            bf16 = iteration_ms(torch.Size(shape), torch.bfloat16, device)
            fp32 = iteration_ms(torch.Size(shape), torch.float32, device)
            print(
                f"{spec:>7} {'x'.join(map(str, shape)):>11} {count:>5} {bf16:>9.2f} {fp32:>9.2f} {bf16 / fp32:>8.1f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,small", help="comma-separated model presets")
    parser.add_argument("--steps", type=int, default=6, help="inner steps per optimizer (the first is not timed)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (capped by the model's context)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument(
        "--iterations",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time Newton-Schulz in bf16 and fp32 per hidden-matrix shape",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {device}, batch {args.batch}, {args.steps} steps")
    print(f"{'model':>7} {'optimizer':>9} {'params':>10} {'matrices':>8} {'state MB':>9} {'B/param':>7} {'step ms':>8}")
    for spec in args.models.split(","):
        context = build_model(spec, 0)[1].get("context_length", args.seq_len)
        seq_len = min(args.seq_len, context)
        for kind in InnerOptimizerKind:
            row = measure(spec, kind, args.steps, args.batch, seq_len, device)
            print(
                f"{spec:>7} {kind.value:>9} {row['params']:>10} {row['matrix_share']:>8.1%} {row['state_mb']:>9.1f} "
                f"{row['state_b_per_param']:>7.2f} {row['step_ms']:>8.1f}"
            )
    if args.iterations:
        print_iterations(args.models.split(","), device)


if __name__ == "__main__":
    main()
