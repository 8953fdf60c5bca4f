"""Convergence: does dtnode train as well per token as synchronous data-parallel, for how much less traffic?

    .venv/bin/python -m tests.bench.convergence                       # CPU size (about 70 min on 2 cores)
    .venv/bin/python -m tests.bench.convergence --datasets text --runs dp,int8-h50
    .venv/bin/python -m tests.bench.convergence --model small --batch-size 8 --seq-len 256 \\
        --steps 3000 --device cuda --out bench-out                      # a GPU box

The same model (seeded: identical initial weights), the same data and the same total tokens,
trained by:
  dp              synchronous data-parallel: W workers, DistributedDataParallel over gloo,
                  gradients all-reduced every step (the baseline)
  solo            one worker alone, W x the steps
  dp-lrX, solo-lrX  the same with peak learning rate X (W x the batch may want a higher rate)
  fp32-hH/int8-hH/sparse-hH
                  dtnode: W real node processes on loopback, one group, H inner steps per
                  round (--pacing fixed), Δ sent in fp32, int8 or sparse (top-k, 2-bit values)
  moshpit-int8-h50 dtnode with groups of 2 (two hops per round)
  ...-efdX        (suffix) a sparse run with error-feedback decay X (--feedback-decay)
  ...-kN          (suffix) a sparse run keeping N of every 4,096 values (--sparse-top-k)
  diloco-hH       reference DiLoCo in W processes over gloo: the same inner loop, fp32 Δ
                  all-reduced every H steps, torch's Nesterov SGD as the outer step. What
                  DiLoCo itself gives, with dtnode's network, int8 and matchmaking left out
  ...-lrX         (suffix) a DiLoCo run with peak inner rate X instead of --inner-lr
  ...-olrX        (suffix) a DiLoCo run with outer rate X instead of --outer-lr
  ...-omX         (suffix) a DiLoCo run with outer momentum X instead of 0.9
  ...-overlap     (suffix) the dtnode run with --overlap: the average runs beside the next
                  round's steps and its outer step lands when it is in ("lands after")
  diloco-hH-delayN the reference with the mean landing N inner steps into the next round
                  (N = H: a whole round late)
  diloco-hH-sparse, diloco-hH-sparselocal (-efdX) (-kN)
                  the reference sending dtnode's sparse code (top 64, or N, of 4096, 2-bit values),
                  what was not sent kept in an error-feedback buffer, or in θ_l
  ...-owN         (suffix, reference) the outer rate warmed up linearly over the first N outer steps
  ...-hrN         (suffix, reference) H ramped up over the first N rounds: round r (from 0) takes
                  max(1, round(H (r + 1) / N)) inner steps, then H (post-local SGD's warm-up)
  ...-hb          (suffix, reference) heavy-ball outer momentum (SGD with momentum, not Nesterov)
  ...-linear, -constant (suffix, reference and dp/solo) the inner rate's decay after warmup (default cosine)
  ...-minlrX      (suffix, reference and dp/solo) the inner rate's floor at the end, as a fraction of its peak (0.1)
  ...-b2X         (suffix, reference and dp/solo) the inner AdamW's β2 (0.95)
  ...-muon        (suffix, every run) Muon as the inner optimizer on the hidden matrices, AdamW on
                  the rest (--inner-optimizer muon, dtnode's default), at the same peak rate; a
                  run without it trains with AdamW (dtnode's runs say --inner-optimizer adamw)
  ...-syncm, -syncv, -syncmv (suffix, reference) AdamW's first, second or both moments averaged
                  over the workers every outer step
  diloco-hH-sparsemeanN, diloco-hH-sparsemeanrN (-efdX)
                  -sparse with the mean cut to its N largest values per block (8-bit values,
                  as a reducer could return it), what the cut dropped fed back by each worker
                  (its own dropped share) or by the part's reducer (all of it, x the group's size)
Every run takes `--steps` inner steps per worker (solo: W x as many) with the same inner
optimizer (AdamW, or Muon with -muon), the same warmup and the same cosine decay over the run
(dtnode: --total-steps). Inner optimizer settings are dtnode's defaults; the outer step is
dtnode's (Nesterov SGD, --outer-lr). The report ends each dataset with the best run of each kind
(dp over both optimizers and every rate tried, each dtnode codec, grouping and H, each H of the
reference): each side at its best.

Datasets: `text` is the source of Python's standard library on this host, split by file
name (one file in 20 held out: the eval text shares no file with the training text);
`synthetic` is dtnode's built-in Markov language (its eval set is a separate sample; its
loss floor is printed). Each run's held-out loss is computed by the same function on the
same eval set: dtnode's final θ_g is read from node 0's last checkpoint.

Printed: final held-out loss, its ratio to dp's (and to the best dp-lrX run's), payload bytes
sent per worker, those bytes per parameter per exchange (dp: per step; dtnode: per round) (dp: a ring all-reduce's 2(W-1)/W x 4 bytes x parameters per step, computed;
dtnode: the all-reduce payload every node reports), wall time, and for dtnode the fraction of
averages in which every group held every peer it expected (a busy host makes peers late to
matchmaking; then the figures are not those of a healthy swarm), and for --overlap runs how many
inner steps into a round the previous round's average landed, on average. Written: loss
against tokens for every run to OUT/convergence.png (matplotlib: `pip install -e '.[bench]'`) and the figures to
OUT/convergence.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import socket
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.utils import parameters_to_vector

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes import NodeProcess, run_swarm

from dtnode.daemon.training.inner_optimizer import build_inner_optimizer
from dtnode.daemon.training.inner_step import held_out_loss, next_token_loss
from dtnode.daemon.training.schedule import LearningRateSchedule
from dtnode.daemon.workload.corpus import TokenCorpus
from dtnode.daemon.workload.data import DataSources, DataStream, MarkovLanguage, stable_seed
from dtnode.daemon.workload.model import build_model
from dtnode.ops import sparse as sparse_codec

RUN_ID = "convergence"
ROUND_LINE = re.compile(r"round (\d+) \|.*\| eval (\d+\.\d+).*\((\d+(?:\.\d+)?) (B|kB|MB|GB|TB) sent\)")
GROUPS = re.compile(r"round \d+ \| groups ([^|]+?) \|")
UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
LR = r"\d+(?:\.\d+)?(?:e-?\d+)?"
OUTER = rf"(?:-lr({LR}))?(?:-olr({LR}))?(?:-om({LR}))?"  # a DiLoCo run's rates and outer momentum
RUN_NAME = re.compile(rf"(moshpit-)?(fp32|int8|sparse)-h(\d+){OUTER}(?:-efd({LR}))?(?:-k(\d+))?(-overlap)?(-muon)?")
# inner-rate decay and floor, AdamW's β2, and Muon as the inner optimizer (--inner-optimizer muon)
SCHEDULE = rf"(?:-(linear|constant))?(?:-minlr({LR}))?(?:-b2({LR}))?(-muon)?"
OUTER_MOMENTUM = 0.9
DEFAULT_RUNS = (  # data-parallel swept for both inner optimizers (its best is the baseline), dtnode's defaults
    "dp,dp-lr0.004,dp-lr0.008,dp-lr0.016,dp-lr0.008-muon,dp-lr0.012-muon,dp-lr0.024-muon,solo,fp32-h50,int8-h10,"
    "int8-h50,int8-h100,int8-h50-overlap,moshpit-int8-h50,sparse-h50,moshpit-sparse-h50,int8-h20-muon,"
    "int8-h10-lr0.016-om0.6-muon,sparse-h10-lr0.016-olr2-muon"
)


@dataclass
class Config:
    model: str
    batch_size: int
    seq_len: int
    steps: int
    workers: int
    inner_lr: float
    outer_lr: float
    warmup_steps: int
    eval_sequences: int
    eval_points: int
    device: str
    seed: int = 0


@dataclass
class Result:
    run: str
    dataset: str
    final_loss: float
    bytes_per_worker: float
    wall_s: float
    tokens: int
    curve: list[tuple[int, float]] = field(default_factory=list)
    exchanges: int = 0  # all-reduces per worker: dp's steps, dtnode's rounds
    full_rounds: float | None = None  # dtnode: fraction of averages in which every group held every peer expected
    landed_after: float | None = None  # --overlap: mean inner steps into a round before the last average landed


@dataclass(frozen=True)
class Reference:
    """The reference DiLoCo's recipe (h = 0: a synchronous data-parallel or solo run)."""

    h: int = 0
    momentum: float = OUTER_MOMENTUM
    delay: int = 0  # inner steps into the next round at which a round's mean lands
    sparse: str = ""  # "", "buffer", "local", "mean:N", "meanr:N" (_reference_sparse)
    feedback_decay: float = 1.0
    top_k: int = sparse_codec.DEFAULT_TOP_K
    outer_warmup: int = 0  # outer steps over which the outer rate rises linearly to its peak
    nesterov: bool = True  # False: heavy-ball momentum (plain SGD with momentum)
    schedule: str = "cosine"  # the inner rate's decay: cosine, linear or constant
    min_lr_ratio: float = 0.1  # the inner rate at the end of the run, as a fraction of its peak
    beta2: float = 0.95  # the inner AdamW's second-moment decay
    sync_moments: str = ""  # "m", "v" or "mv": AdamW's first and/or second moments averaged every outer step
    optimizer: str = "adamw"  # the inner optimizer (dtnode's --inner-optimizer)
    h_ramp: int = 0  # rounds over which H grows linearly to its value (0: every round is H steps)

    def round_ends(self, steps: int) -> list[int]:
        """The inner steps (counted from 1) after which a round's Δ is averaged: every H, or with
        `h_ramp` shorter rounds first; the run's last step always ends a round."""
        if not self.h:
            return []
        ends, done, r = [], 0, 0
        while done < steps:
            done = min(steps, done + (max(1, round(self.h * (r + 1) / self.h_ramp)) if r < self.h_ramp else self.h))
            ends.append(done)
            r += 1
        return ends


# ---- data -------------------------------------------------------------------------------
def stdlib_text(workdir: Path) -> tuple[Path, Path]:
    """train.txt and eval.txt from the standard library's .py files, split by file name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held_out = workdir / "train.txt", workdir / "eval.txt"
    with train.open("wb") as t, held_out.open("wb") as e:
        for path in sorted(root.rglob("*.py")):
            name = str(path.relative_to(root))
            if "site-packages" in name or "/test" in name or name.startswith("test"):
                continue
            bucket = hashlib.sha256(name.encode()).digest()[0] % 20
            (e if bucket == 0 else t).write(path.read_bytes() + b"\n\n")
    return train, held_out


def sources_for(dataset: str, files: tuple[Path, Path] | None, seed: int) -> DataSources:
    if dataset == "synthetic":  # what a node builds without --data
        language = MarkovLanguage(stable_seed(RUN_ID, seed, "language"))
        return DataSources(language, language)
    train, held_out = (TokenCorpus(np.memmap(f, dtype=np.uint8, mode="r"), str(f), id_bound=256) for f in files)
    return DataSources(train, held_out)


# ---- synchronous baselines --------------------------------------------------------------
def _worker(
    rank: int,
    world: int,
    cfg: Config,
    dataset: str,
    files,
    port: int,
    out: str,
    ref: Reference,
) -> None:
    """One synchronous worker; with ref.h > 0 a reference DiLoCo replica instead of a DDP one.

    With `ref.sparse` the reference sends top-`ref.top_k`-of-4096 2-bit Δ (dtnode's ops/sparse.py codec)
    and all-reduces what was sent: `buffer` keeps what was not sent in an error-feedback buffer
    added to the next Δ (SparseLoCo; θ_l restarts from θ_g), `local` keeps it in θ_l instead
    (θ_l ← θ_g − what was not sent), so the next Δ holds it without the inner steps having to
    find it again.

    The reference is the textbook algorithm in a few lines (fp32 Δ averaged by gloo's all-reduce,
    torch's own Nesterov SGD as the outer step), so a gap between dtnode and data-parallel can be
    told apart from a gap between DiLoCo and data-parallel. With `ref.delay` > 0 the mean of a round's
    Δ lands `delay` inner steps into the next round, as an average that runs beside them would:
    the outer step is made then, and the progress since the round began is kept on top of it."""
    h, delay, sparse, feedback_decay, top_k = ref.h, ref.delay, ref.sparse, ref.feedback_decay, ref.top_k
    round_ends = set(ref.round_ends(cfg.steps * cfg.workers // world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device(cfg.device)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, _ = build_model(cfg.model, stable_seed(RUN_ID, cfg.seed, "init"))
    model = model.to(device)
    steps = cfg.steps * cfg.workers // world
    sources = sources_for(dataset, files, cfg.seed)
    stream = DataStream(sources, RUN_ID, f"sync-{world}-{rank}", cfg.batch_size, cfg.seq_len, cfg.eval_sequences)
    optimizer = build_inner_optimizer(model, cfg.inner_lr, 0.1, ref.optimizer)
    for group in optimizer.param_groups:
        if "betas" in group:  # AdamW's groups (Muon's have a momentum instead)
            group["betas"] = (group["betas"][0], ref.beta2)
    schedule = LearningRateSchedule(cfg.inner_lr, cfg.warmup_steps, steps, ref.schedule, ref.min_lr_ratio)
    trained = torch.nn.parallel.DistributedDataParallel(model) if world > 1 and not h else model
    params = list(model.parameters())
    if h:  # θ_g and the outer optimizer over it; θ_l = θ_g − (own Δ in flight) − progress since
        theta_g = torch.nn.Parameter(parameters_to_vector(params).detach().clone())
        outer = torch.optim.SGD(
            [theta_g], lr=cfg.outer_lr, momentum=ref.momentum, nesterov=ref.nesterov and ref.momentum > 0
        )
        outer_steps = 0
        in_flight, pending = torch.zeros_like(theta_g), None  # own Δ, and the mean not yet applied
        unsent = torch.zeros_like(theta_g)  # sparse: what this worker has not sent yet
    tokens_per_step = world * cfg.batch_size * cfg.seq_len
    eval_every = max(h, (steps // cfg.eval_points) // max(h, 1) * max(h, 1), 1)
    curve = []

    @torch.no_grad()
    def land(mean: torch.Tensor) -> None:
        """The outer step with a mean; θ_l keeps the progress made since its Δ was taken."""
        nonlocal outer_steps
        progress = theta_g.detach() - in_flight - parameters_to_vector(params)
        theta_g.grad = mean
        for group in outer.param_groups:  # a linear warm-up of the outer rate over ref.outer_warmup steps
            group["lr"] = cfg.outer_lr * min(1.0, (outer_steps + 1) / max(ref.outer_warmup, 1))
        outer.step()
        outer_steps += 1
        in_flight.zero_()
        kept = unsent * feedback_decay if sparse == "local" else 0
        _copy_into(theta_g.detach() - progress - kept, params)

    def evaluate() -> float:
        if not h:
            return held_out_loss(model, stream.eval_set, device)
        local = parameters_to_vector(params).detach().clone()
        _copy_into(theta_g.detach(), params)
        try:
            return held_out_loss(model, stream.eval_set, device)
        finally:
            _copy_into(local, params)

    started = time.monotonic()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule(step)
        loss = next_token_loss(trained, stream.next_batch(), device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients here
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if h and pending is not None and (step + 1) % h == delay % h:  # the mean of the last round lands
            land(pending)
            pending = None
        if (step + 1) in round_ends:
            with torch.no_grad():
                in_flight.copy_(theta_g.detach() - parameters_to_vector(params))  # this round's Δ
                if sparse == "buffer" or sparse.startswith("mean"):
                    payload = sparse_codec.encode_with_feedback(in_flight, unsent, k=top_k, decay=feedback_decay)
                    pending = sparse_codec.decode(payload)
                elif sparse == "local":
                    pending = sparse_codec.decode(sparse_codec.encode(in_flight, k=top_k))
                    torch.sub(in_flight, pending, out=unsent)
                else:
                    pending = in_flight.clone()
                dist.all_reduce(pending)
                pending.div_(world)
                for state in optimizer.state.values() if ref.sync_moments else ():
                    for key in {"v": ("exp_avg_sq",), "m": ("exp_avg",), "mv": ("exp_avg", "exp_avg_sq")}[
                        ref.sync_moments
                    ]:
                        dist.all_reduce(state[key])
                        state[key].div_(world)
                if sparse.startswith("mean"):  # the mean cut to top-k again (int8 values), the cut mass fed back
                    cut = int(sparse.split(":")[1])
                    result = sparse_codec.encode_mean(pending, k=cut)
                    if sparse.startswith("meanr"):  # by the part's reducer, for the whole group
                        lost = pending - sparse_codec.decode(result)
                        part = lost.numel() // world // 4096 * 4096
                        lo, hi = rank * part, (lost.numel() if rank == world - 1 else (rank + 1) * part)
                        unsent[lo:hi] += world * lost[lo:hi]
                    else:
                        _carry_dropped(payload, result, unsent)
                    pending = sparse_codec.decode(result)
            if not delay or step + 1 == steps:  # at once (the last round's too)
                land(pending)
                pending = None
        if rank == 0 and ((step + 1) % eval_every == 0 or step + 1 == steps):
            curve.append(((step + 1) * tokens_per_step, evaluate()))
    wall = time.monotonic() - started
    if rank == 0:
        numel = sum(p.numel() for p in params)
        exchanges = len(round_ends) if h else steps
        sent = 2 * (world - 1) / world * 4 * numel * exchanges if world > 1 else 0.0
        if sparse.startswith("mean"):  # a reduce-scatter: payloads to the reducers, the cut means back
            cut = sparse_codec.support_bytes_per_value(4096, int(sparse.split(":")[1]))
            per_value = sparse_codec.bytes_per_value(4096, top_k) + cut
            sent = (world - 1) / world * per_value * numel * exchanges
        elif sparse:  # an all-gather of every worker's sparse payload
            sent = (world - 1) * sparse_codec.bytes_per_value(4096, top_k) * numel * exchanges
        Path(out).write_text(json.dumps({"curve": curve, "wall_s": wall, "bytes": sent}))
    if world > 1:
        dist.destroy_process_group()


def _carry_dropped(sent: sparse_codec.SparseBlocks, result: sparse_codec.SparseBlocks, unsent: torch.Tensor) -> None:
    """unsent += what `sent` carried at positions the cut mean `result` did not keep: each worker
    takes back its own share of what the cut dropped (the shares sum to the mean there)."""
    kept = torch.zeros(result.numel, dtype=torch.bool)
    kept[sparse_codec.positions(result)] = True
    where = sparse_codec.positions(sent)
    dropped = ~kept[where]
    unsent.index_add_(0, where[dropped], sparse_codec.values_of(sent)[dropped])


@torch.no_grad()
def _copy_into(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Parameters ← a flat vector, in place (torch's vector_to_parameters re-points them at it)."""
    offset = 0
    for p in params:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def run_synchronous(
    name: str,
    world: int,
    cfg: Config,
    dataset: str,
    files,
    workdir: Path,
    ref: Reference | None = None,
) -> Result:
    ref = ref or Reference()
    h = ref.h
    out = workdir / f"{name}-{dataset}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.spawn(
        _worker,
        args=(world, cfg, dataset, files, port, str(out), ref),
        nprocs=world,
        join=False,
    )
    written = None  # once rank 0 wrote its figures, a worker stuck in the teardown is ended
    while not context.join(timeout=5):
        if out.exists():
            written = written or time.monotonic()
            if time.monotonic() - written > 60:
                print(f"  {name}: a worker did not exit 60 s after the figures were written; ending it")
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                break
    data = json.loads(out.read_text())
    curve = [tuple(p) for p in data["curve"]]
    exchanges = len(ref.round_ends(cfg.steps * cfg.workers // world)) if h else cfg.steps * cfg.workers // world
    return Result(name, dataset, curve[-1][1], data["bytes"], data["wall_s"], curve[-1][0], curve, exchanges)


# ---- dtnode ------------------------------------------------------------------------------
def run_dtnode(
    name: str,
    h: int,
    compression: str,
    group_size: int,
    outer_lr: float | None,
    momentum: float | None,
    overlap: bool,
    cfg: Config,
    dataset: str,
    files,
    workdir: Path,
    feedback_decay: float | None = None,
    top_k: int = 64,
    inner_optimizer: str = "adamw",
) -> Result:
    rounds = cfg.steps // h
    args = [
        "--run-id",
        RUN_ID,
        "--seed",
        str(cfg.seed),
        "--model",
        cfg.model,
        "--device",
        cfg.device,
        "--batch-size",
        str(cfg.batch_size),
        "--seq-len",
        str(cfg.seq_len),
        "--inner-steps",
        str(h),
        "--pacing",
        "fixed",
        "--max-rounds",
        str(rounds),
        "--total-steps",
        str(rounds * h),
        "--warmup-steps",
        str(cfg.warmup_steps),
        "--inner-lr",
        str(cfg.inner_lr),
        "--compression",
        compression,
        "--inner-optimizer",
        inner_optimizer,
        "--sparse-top-k",
        str(top_k),
        "--target-group-size",
        str(group_size),
        "--min-peers",
        str(cfg.workers),
        "--eval-sequences",
        str(cfg.eval_sequences),
        "--checkpoint-every",
        "1000000",
        "--no-fused-kernels",
        "--join-timeout",
        "120",
        "--allreduce-timeout",
        "120",
    ]
    # a sparse run not told otherwise takes the node's sparse defaults (its outer step, its decay)
    for option, value in (
        ("--outer-lr", outer_lr),
        ("--outer-momentum", momentum),
        ("--feedback-decay", feedback_decay),
    ):
        if value is not None:
            args += [option, str(value)]
    if dataset == "text":
        args += ["--data", str(files[0]), "--eval-data", str(files[1])]
    if overlap:
        args.append("--overlap")
    threads = str(max(1, (os.cpu_count() or 1) // cfg.workers))
    env = {"OMP_NUM_THREADS": threads}
    base = workdir / f"{name}-{dataset}"
    started = time.monotonic()
    nodes = run_swarm(
        NodeProcess.join("n0", base, *args, env=env),
        lambda address: [
            NodeProcess.join(f"n{i}", base, *args, "--peer", address, env=env) for i in range(1, cfg.workers)
        ],
    )
    wall = time.monotonic() - started
    for node in nodes:
        if "Traceback" in node.output:
            print(f"  warning: a traceback in {name}/{node.name}'s log", file=sys.stderr)
    tokens_per_round = cfg.workers * h * cfg.batch_size * cfg.seq_len
    curve, sent = [], []
    averages = [groups.split() for node in nodes for groups in GROUPS.findall(node.output) if groups != "-"]
    full = sum(all(a == b for a, b in (g.split("+")[0].split("/") for g in hops)) for hops in averages)
    for node in nodes:
        rows = [m.groups() for line in node.lines if (m := ROUND_LINE.search(line))]
        sent.append(sum(float(value) * UNITS[unit] for _, _, value, unit in rows))
        if node is nodes[0]:
            # the eval of round r's line is θ_g after outer step r + 1 (with --overlap: r, a round late)
            lag = 0 if overlap else 1
            curve = [((int(r) + lag) * tokens_per_round, float(loss)) for r, loss, _, _ in rows]
    final = final_loss_of(nodes[0].state_dir, cfg, dataset, files)
    history = [
        json.loads(line) for node in nodes for line in (node.state_dir / "history.jsonl").read_text().splitlines()
    ]
    landed = [e["landed_after_steps"] for e in history if e.get("landed_after_steps") is not None]
    return Result(
        name,
        dataset,
        final,
        sum(sent) / len(sent),
        wall,
        rounds * tokens_per_round,
        curve,
        rounds,
        full / max(len(averages), 1),
        sum(landed) / len(landed) if overlap and landed else None,
    )


def final_loss_of(state_dir: Path, cfg: Config, dataset: str, files) -> float:
    """The held-out loss of θ_g in the node's newest checkpoint, by the baselines' own function."""
    from safetensors.torch import load_file

    from dtnode.daemon.checkpoints.file_format import list_checkpoints

    newest = list_checkpoints(state_dir)[0][1]
    tensors = load_file(str(newest))
    model, _ = build_model(cfg.model, 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[f"theta_g/{name}"])
    return loss_of(model, cfg, dataset, files)


def loss_of(model: torch.nn.Module, cfg: Config, dataset: str, files) -> float:
    device = torch.device(cfg.device)
    stream = DataStream(sources_for(dataset, files, cfg.seed), RUN_ID, "eval", 1, cfg.seq_len, cfg.eval_sequences)
    return held_out_loss(model.to(device), stream.eval_set, device)


def _reference_sparse(suffix: str | None) -> str:
    """The reference's sparse mode from its run-name suffix (-sparse, -sparselocal, -sparsemeanN,
    -sparsemeanrN: the mean cut to N values per block, the cut fed back by its senders or reducer)."""
    if not suffix:
        return ""
    if m := re.fullmatch(r"-sparse(meanr?)(\d+)", suffix):
        return f"{m.group(1)}:{m.group(2)}"
    return {"-sparse": "buffer", "-sparselocal": "local"}[suffix]


def run_one(name: str, cfg: Config, dataset: str, files, workdir: Path) -> Result:
    if m := re.fullmatch(rf"(dp|solo)(?:-lr({LR}))?{SCHEDULE}", name):
        tuned = replace(cfg, inner_lr=float(m.group(2))) if m.group(2) else cfg
        ref = Reference(
            schedule=m.group(3) or "cosine",
            min_lr_ratio=float(m.group(4) or 0.1),
            beta2=float(m.group(5) or 0.95),
            optimizer="muon" if m.group(6) else "adamw",
        )
        return run_synchronous(name, cfg.workers if m.group(1) == "dp" else 1, tuned, dataset, files, workdir, ref)
    if m := re.fullmatch(
        rf"diloco-h(\d+){OUTER}(?:-delay(\d+))?(-sparse(?:local|meanr?\d+)?)?(?:-efd({LR}))?(?:-k(\d+))?"
        rf"(?:-ow(\d+))?(-hb)?(?:-sync(mv|m|v))?(?:-hr(\d+))?{SCHEDULE}",
        name,
    ):
        if m.group(8) and not m.group(6):
            raise SystemExit(f"run {name!r}: -kN sets the values a sparse run keeps; add -sparse")
        tuned = replace(cfg, inner_lr=float(m.group(2) or cfg.inner_lr), outer_lr=float(m.group(3) or cfg.outer_lr))
        ref = Reference(
            h=int(m.group(1)),
            momentum=float(m.group(4) or OUTER_MOMENTUM),
            delay=int(m.group(5) or 0),
            sparse=_reference_sparse(m.group(6)),
            feedback_decay=float(m.group(7) or 1.0),
            top_k=int(m.group(8) or sparse_codec.DEFAULT_TOP_K),
            outer_warmup=int(m.group(9) or 0),
            nesterov=not m.group(10),
            sync_moments=m.group(11) or "",
            h_ramp=int(m.group(12) or 0),
            schedule=m.group(13) or "cosine",
            min_lr_ratio=float(m.group(14) or 0.1),
            beta2=float(m.group(15) or 0.95),
            optimizer="muon" if m.group(16) else "adamw",
        )
        if ref.h_ramp and ref.delay:
            raise SystemExit(f"run {name!r}: -hrN and -delayN do not combine")
        return run_synchronous(name, cfg.workers, tuned, dataset, files, workdir, ref)
    m = RUN_NAME.fullmatch(name)
    if not m:
        raise SystemExit(f"unknown run {name!r}")
    group = 2 if m.group(1) else cfg.workers
    tuned = replace(cfg, inner_lr=float(m.group(4))) if m.group(4) else cfg
    sparse = m.group(2) == "sparse"
    outer_lr = float(m.group(5)) if m.group(5) else None if sparse else cfg.outer_lr
    return run_dtnode(
        name,
        int(m.group(3)),
        m.group(2),
        group,
        outer_lr,
        float(m.group(6)) if m.group(6) else None if sparse else OUTER_MOMENTUM,
        bool(m.group(9)),
        tuned,
        dataset,
        files,
        workdir,
        float(m.group(7)) if m.group(7) else None,
        int(m.group(8) or 64),
        "muon" if m.group(10) else "adamw",
    )


# ---- report ------------------------------------------------------------------------------
def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def report(results: list[Result], cfg: Config, floors: dict[str, float | None]) -> None:
    print(
        f"\nmodel {cfg.model}, {cfg.workers} workers x {cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} tokens "
        f"(total {cfg.workers * cfg.steps * cfg.batch_size * cfg.seq_len / 1e6:.2f}M tokens per run)"
    )
    for dataset in dict.fromkeys(r.dataset for r in results):
        rows = [r for r in results if r.dataset == dataset]
        dp = next((r for r in rows if r.run == "dp"), None)
        best = min((r for r in rows if r.run.startswith("dp")), key=lambda r: r.final_loss, default=None)
        dp_bytes = (dp or best).bytes_per_worker if (dp or best) else 0.0  # every dp rate sends the same
        floor = floors.get(dataset)
        print(
            f"\n{dataset}"
            + (f" (loss floor {floor:.4f})" if floor else "")
            + (f"; best dp: {best.run}" if best is not None and best is not dp else "")
        )
        rates = sorted({_dp_rate(r.run, cfg) for r in rows if r.run.startswith("dp")})
        if best is not None and len(rates) < 3:
            print(f"  (dp ran at {len(rates)} learning rate(s): fewer than 3 cannot show its best)")
        elif best is not None and _dp_rate(best.run, cfg) in (rates[0], rates[-1]):
            print(f"  (the best dp rate is the edge of those tried, {rates[0]:g}..{rates[-1]:g}: try beyond it)")
        width = max([22, *(len(r.run) for r in rows)])
        print(
            f"  {'run':<{width}} {'held-out loss':>13} {'/ dp':>7} {'/ best dp':>9} {'sent per worker':>16} "
            f"{'dp bytes /':>11} {'B/param/xchg':>12} {'wall':>8} {'full rounds':>11} {'lands after':>11}"
        )
        numel = sum(p.numel() for p in build_model(cfg.model, 0)[0].parameters())
        for r in rows:
            per_param = f"{r.bytes_per_worker / numel / r.exchanges:.4f}" if r.exchanges else "-"
            ratio = f"{r.final_loss / dp.final_loss:.4f}" if dp else "-"
            to_best = f"{r.final_loss / best.final_loss:.4f}" if best else "-"
            less = f"{dp_bytes / r.bytes_per_worker:.0f}x" if dp_bytes and r.bytes_per_worker else "-"
            full = "-" if r.full_rounds is None else f"{r.full_rounds:.0%}"
            landed = "-" if r.landed_after is None else f"{r.landed_after:.1f} steps"
            print(
                f"  {r.run:<{width}} {r.final_loss:>13.4f} {ratio:>7} {to_best:>9} {_bytes(r.bytes_per_worker):>16} "
                f"{less:>11} {per_param:>12} {r.wall_s:>7.1f}s {full:>11} {landed:>11}"
            )
        if best is not None and len(rows) > 1:
            _report_best(rows, best, width)


def _kind(run: str) -> str:
    """What a run is, its rates and the optimizers' other knobs left out: runs of one kind are the
    same method swept, and the table of each side at its best takes the lowest of each kind."""
    if run.startswith(("dp", "solo")):
        return run.split("-")[0]
    if m := re.match(r"diloco-h(\d+)", run):
        return f"reference H={m.group(1)}" + (" sparse" if "-sparse" in run else "")
    if m := RUN_NAME.fullmatch(run):
        return f"{'moshpit ' if m.group(1) else ''}{m.group(2)} H={m.group(3)}" + (" overlap" if m.group(9) else "")
    return run


def best_of_each_kind(rows: list[Result]) -> list[Result]:
    """Each kind's run of lowest held-out loss, in the order the kinds first appear (dp over both
    inner optimizers and every rate tried: the baseline at its best)."""
    best: dict[str, Result] = {}
    for r in rows:
        kind = _kind(r.run)
        if kind not in best or r.final_loss < best[kind].final_loss:
            best[kind] = r
    return list(best.values())


def _report_best(rows: list[Result], dp_best: Result, width: int) -> None:
    tried = {kind: sum(_kind(r.run) == kind for r in rows) for kind in map(_kind, (r.run for r in rows))}
    print("  each at its best (the lowest held-out loss of each kind, over the runs of it tried):")
    print(f"  {'kind':<24} {'tried':>5}  {'best run':<{width}} {'held-out loss':>13} {'/ best dp':>9}")
    for r in best_of_each_kind(rows):
        kind = _kind(r.run)
        print(
            f"  {kind:<24} {tried[kind]:>5}  {r.run:<{width}} {r.final_loss:>13.4f} "
            f"{r.final_loss / dp_best.final_loss:>9.4f}"
        )


def _dp_rate(run: str, cfg: Config) -> float:
    """The peak learning rate of a dp run: `dp` runs at --inner-lr, `dp-lrX` at X."""
    m = re.match(rf"dp-lr({LR})", run)
    return float(m.group(1)) if m else cfg.inner_lr


def plot(results: list[Result], path: Path, floors: dict[str, float | None]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r.dataset for r in results))
    fig, axes = plt.subplots(1, len(datasets), figsize=(7 * len(datasets), 5), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for r in (r for r in results if r.dataset == dataset):
            xs, ys = zip(*r.curve)
            style = {"dp": {"color": "black", "lw": 2}, "solo": {"color": "gray", "ls": "--"}}.get(r.run, {})
            if r.run.startswith("dp-"):
                style = {"color": "black", "ls": ":"}
            ax.plot([x / 1e6 for x in xs], ys, label=r.run, **style)
        if floors.get(dataset):
            ax.axhline(floors[dataset], color="red", ls=":", label="loss floor")
        ax.set_title(f"held-out loss, {dataset}")
        ax.set_xlabel("tokens (millions, all workers)")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="text,synthetic")
    parser.add_argument("--runs", default=DEFAULT_RUNS)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1000, help="inner steps per worker (a multiple of every H)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--inner-lr", type=float, default=1e-3)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--eval-sequences", type=int, default=256)
    parser.add_argument("--eval-points", type=int, default=20, help="evaluations along a synchronous run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument(
        "--include",
        type=Path,
        action="append",
        default=[],
        help="an earlier run's convergence.json (same config) whose results join this run's table and plot "
        "(repeatable; with --runs '' the merged report alone)",
    )
    args = parser.parse_args()
    cfg = Config(
        args.model,
        args.batch_size,
        args.seq_len,
        args.steps,
        args.workers,
        args.inner_lr,
        args.outer_lr,
        args.warmup_steps,
        args.eval_sequences,
        args.eval_points,
        args.device,
    )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("the convergence benchmark plots with matplotlib: pip install -e '.[bench]'") from None
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    floors: dict[str, float | None] = {}
    for included in args.include:
        earlier = json.loads(included.read_text())
        if earlier["config"] != asdict(cfg):
            raise SystemExit(f"{included} was run with another configuration: {earlier['config']}")
        results += [Result(**{**r, "curve": [tuple(p) for p in r["curve"]]}) for r in earlier["results"]]
        floors |= earlier.get("floors", {})
    runs = [name for name in args.runs.split(",") if name]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        files = stdlib_text(workdir) if runs and "text" in args.datasets.split(",") else None
        if files:
            print(
                f"text: {files[0].stat().st_size / 1e6:.1f} MB train, {files[1].stat().st_size / 1e6:.1f} MB held out"
            )
        for dataset in args.datasets.split(",") if runs else []:
            floors[dataset] = sources_for(dataset, files, cfg.seed).loss_floor
            initial = loss_of(build_model(cfg.model, stable_seed(RUN_ID, cfg.seed, "init"))[0], cfg, dataset, files)
            for name in runs:
                result = run_one(name, cfg, dataset, files, workdir)
                result.curve.insert(0, (0, initial))
                print(
                    f"  {dataset:<9} {name:<22} held-out {result.final_loss:.4f}  sent {_bytes(result.bytes_per_worker)}"
                    f"  {result.wall_s:.1f}s",
                    flush=True,
                )
                results.append(result)
    report(results, cfg, floors)
    plot(results, args.out / "convergence.png", floors)
    (args.out / "convergence.json").write_text(
        json.dumps({"config": asdict(cfg), "floors": floors, "results": [asdict(r) for r in results]}, indent=1)
    )
    print(f"\nwrote {args.out / 'convergence.png'} and {args.out / 'convergence.json'}")


if __name__ == "__main__":
    main()
