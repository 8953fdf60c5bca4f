"""Inner-step throughput and model FLOPs utilization (MFU), and the outer round's device-side overhead.

    python -m tests.bench.throughput                  # sizes for this host (small on a CPU)
    python -m tests.bench.throughput --gpu-sizes      # the `base` preset and a 125M Llama at sequence 1024

Runs dtnode's own inner loop (Trainer: bf16 autocast and fused AdamW on CUDA) with and without
`--compile`, for a built-in preset and a `transformers` Llama (`hf:` path). MFU counts 6N + 12·L·d·T
FLOPs per token (PaLM's estimate, as nanoGPT's) against two peaks: a bf16 (GPU) or fp32 (CPU) matmul
measured in the same run, and on an H100 its datasheet 989 TFLOP/s. The outer overhead is the
device-side work of one round (Δ to the host, the Nesterov step on θ_g, θ_l reset) against H=100
inner steps, counted as if nothing overlapped (the copy of Δ runs on a stream of its own).
"Δ to the wire" times Δ's int8 encoding on the host after an fp32 copy (the node's path) against
encoding on the device and copying the codes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dtnode.daemon.training.outer_replica import Replica
from dtnode.daemon.training.schedule import LearningRateSchedule
from dtnode.daemon.training.trainer import Trainer
from dtnode.daemon.workload.data import DataSources, DataStream, MarkovLanguage
from dtnode.daemon.workload.model import build_model

H100_BF16_PEAK = 989e12  # dense, SXM datasheet


@dataclass
class Case:
    name: str
    spec: str  # a preset, or "llama:" + hidden,layers,heads,intermediate,vocab
    seq_len: int
    batch: int


GPU_CASES = [Case("base preset (GPT)", "base", 1024, 16), Case("Llama via hf:", "llama:768,12,12,2048,32000", 1024, 16)]
CPU_CASES = [Case("small preset (GPT)", "small", 256, 4), Case("Llama via hf:", "llama:384,6,6,1024,8192", 256, 4)]


def _model_spec(case: Case, scratch: Path) -> str:
    if not case.spec.startswith("llama:"):
        return case.spec
    import transformers

    hidden, layers, heads, inter, vocab = map(int, case.spec.removeprefix("llama:").split(","))
    directory = scratch / case.spec.replace(":", "-").replace(",", "-")
    transformers.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=case.seq_len,
        tie_word_embeddings=True,
    ).save_pretrained(directory)
    return f"hf:{directory}"


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    n = sum(p.numel() for p in model.parameters())
    layers = [m for m in model.modules() if m.__class__.__name__ in ("Block", "LlamaDecoderLayer")]
    width = next(p.shape[-1] for name, p in model.named_parameters() if "emb" in name or name.endswith("tok.weight"))
    return 6 * n + 12 * len(layers) * width * seq_len


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of a large matmul in the training dtype: the ceiling this device reaches in practice."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = 8192 if device.type == "cuda" else 2048
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    reps = 50 if device.type == "cuda" else 5
    best = 0.0
    for _ in range(3):  # the best of three: the ceiling, not an average disturbed by other work
        _sync(device)
        started = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        best = max(best, 2 * size**3 * reps / (time.perf_counter() - started))
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    case: Case, device: torch.device, compile: bool, steps: int, warmup: int, scratch: Path, prefetch: bool = True
) -> dict:
    model, _ = build_model(_model_spec(case, scratch), seed=0)
    language = MarkovLanguage(seed=1, vocab_size=256)
    stream = DataStream(DataSources(language, None), "bench", "peer", case.batch, case.seq_len, eval_sequences=0)
    trainer = Trainer(
        model, stream, device, schedule=LearningRateSchedule(3e-4), weight_decay=0.1, grad_clip=1.0, compile=compile
    )
    trainer.prefetch_batches = prefetch and trainer.prefetch_batches  # on a GPU, unless the baseline row
    stop = threading.Event()
    started = time.perf_counter()
    trainer.run(warmup, stop)  # includes the compile
    _sync(device)
    warm_s = time.perf_counter() - started
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        trainer.run(1, stop)
        _sync(device)
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    replica = Replica(trainer, 0.7, 0.9)
    outer = []
    for _ in range(5):  # the device-side part of an outer round
        t = time.perf_counter()
        delta = replica.pseudo_gradient()
        replica.apply_outer_step(delta)
        _sync(device)
        outer.append(time.perf_counter() - t)
    tokens = case.batch * case.seq_len
    outer_s = statistics.median(outer)
    return {
        "case": case.name + ("" if prefetch or device.type != "cuda" else ", no prefetch"),
        "compile": compile,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "flops_per_s": flops_per_token(model, case.seq_len) * tokens / step_s,
        "warmup_s": warm_s,
        "outer_s": outer_s,
        "outer_share_at_h_100": outer_s / (100 * step_s),
    }


def delta_to_wire(numel: int, device: torch.device, reps: int = 5) -> dict:
    """Where Δ's int8 encoding belongs: on the host after an fp32 copy (what the node does), or
    on the device with a 4x smaller copy. Either way the result is the int8 codes and scales on
    the host. The data plane encodes chunk by chunk while it streams (butterfly.py), so the
    host encoding costs a round nothing unless it emits fewer bytes per second than the link."""
    from dtnode.ops.quantization import QuantizedBlocks, num_blocks, quantize, use_fused_kernels

    pin = device.type == "cuda"
    block = 256
    source = torch.randn(numel, device=device)
    host_fp32 = torch.empty(numel, pin_memory=pin)
    host_q = QuantizedBlocks(
        torch.empty(numel, dtype=torch.int8, pin_memory=pin),
        torch.empty(num_blocks(numel, block), pin_memory=pin),
        block,
    )
    device_q = QuantizedBlocks(
        torch.empty(numel, dtype=torch.int8, device=device), torch.empty(num_blocks(numel, block), device=device), block
    )

    def on_host() -> None:
        host_fp32.copy_(source, non_blocking=pin)
        _sync(device)
        quantize(host_fp32, block, out=host_q)

    def on_device() -> None:
        quantize(source, block, out=device_q)
        host_q.codes.copy_(device_q.codes, non_blocking=pin)
        host_q.scales.copy_(device_q.scales, non_blocking=pin)
        _sync(device)

    def copy_only() -> None:
        host_fp32.copy_(source, non_blocking=pin)
        _sync(device)

    fused = use_fused_kernels(True)  # as a node does once its first inner step is done
    timings = {}
    for name, fn in (("copy", copy_only), ("host", on_host), ("device", on_device)):
        fn()
        samples = []
        for _ in range(reps):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        timings[name] = statistics.median(samples)
    use_fused_kernels(False)
    encoded_bits = 8 * (numel + 4 * num_blocks(numel, block))
    return {
        "numel": numel,
        "fused": fused,
        "copy_s": timings["copy"],
        "host_s": timings["host"],
        "device_s": timings["device"],
        "host_encode_gbit_s": encoded_bits / (timings["host"] - timings["copy"]) / 1e9
        if timings["host"] > timings["copy"]
        else float("inf"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--gpu-sizes", action="store_true", help="the 124M/125M models at sequence 1024 (default on a GPU)"
    )
    parser.add_argument("--steps", type=int, default=10, help="measured inner steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="inner steps before measuring (the compile runs here)")
    parser.add_argument("--no-compile-runs", action="store_true", help="skip the --compile runs")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--case", default="", help="only the cases whose name holds this text")
    args = parser.parse_args()
    device = torch.device(args.device)
    big = args.gpu_sizes or device.type == "cuda"
    cases = [c for c in (GPU_CASES if big else CPU_CASES) if args.case in c.name]
    if device.type == "cpu":
        torch.set_num_threads(torch.get_num_threads())
        print(
            f"CPU host ({torch.get_num_threads()} threads): {'GPU' if big else 'small'} sizes; the GPU path "
            "(bf16 autocast, fused AdamW, compile on CUDA) is not exercised here"
        )
    peak = matmul_peak(device)
    print(
        f"device {device}: measured matmul peak {peak / 1e12:.2f} TFLOP/s"
        + (f"; datasheet H100 bf16 {H100_BF16_PEAK / 1e12:.0f}" if device.type == "cuda" else "")
    )
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for case in cases:
            for compile in (False, True)[: 1 if args.no_compile_runs else 2]:
                rows.append(measure(case, device, compile, args.steps, args.warmup, Path(scratch)))
            if device.type == "cuda":  # the baseline: the next batch drawn after each step, not during it
                rows.append(measure(case, device, False, args.steps, args.warmup, Path(scratch), prefetch=False))
    header = f"{'model':32s} {'compile':>7s} {'params':>8s} {'seq':>5s} {'tok/s':>10s} {'MFU meas.':>9s}"
    header += f" {'MFU H100':>9s}" if device.type == "cuda" else ""
    print(header + f" {'warmup':>8s} {'outer':>8s} {'outer/H=100':>11s}")
    for row, case in zip(rows, [c for c in cases for _ in range(len(rows) // len(cases))]):
        line = (
            f"{row['case']:32s} {row['compile']!s:>7s} {row['params_m']:7.1f}M {case.seq_len:5d} "
            f"{row['tokens_per_s']:10.0f} {row['flops_per_s'] / peak:9.1%}"
        )
        if device.type == "cuda":
            line += f" {row['flops_per_s'] / H100_BF16_PEAK:9.1%}"
        print(line + f" {row['warmup_s']:7.1f}s {row['outer_s'] * 1e3:6.1f}ms {row['outer_share_at_h_100']:11.2%}")
    numel = max(int(row["params_m"] * 1e6) for row in rows)
    wire = delta_to_wire(numel, device)
    print(
        f"\nΔ to the wire, {numel / 1e6:.1f}M values (median of 5): fp32 copy to the host "
        f"{wire['copy_s'] * 1e3:.1f}ms; int8 on the host after it {wire['host_s'] * 1e3:.1f}ms "
        f"({'compiled' if wire['fused'] else 'eager'} kernels, the node's path); int8 on the device, then "
        f"its copy {wire['device_s'] * 1e3:.1f}ms"
        + (" (on a CPU both run on the host)" if device.type == "cpu" else "")
    )
    print(
        f"  host encoding emits {wire['host_encode_gbit_s']:.1f} Gbit/s of int8: the stream encodes chunk k+1 "
        "while chunk k is on the wire, so a link slower than this never waits for it"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"device": str(device), "peak_flops": peak, "rows": rows, "delta_to_wire": wire}, indent=2)
        )


if __name__ == "__main__":
    main()
