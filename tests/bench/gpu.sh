#!/usr/bin/env bash
# The GPU checks of one device session, in order of value, each under its own time limit so that
# one failure leaves the others' figures: the CUDA tests, the trainer's throughput (bf16, compile),
# the codecs on the device, a CUDA node in a real two-host swarm. Needs a CUDA torch and dtnode's
# dependencies on PYTHONPATH (tests/bench/gpu_wheels.sh makes them wheels for a machine without a
# package index); logs go to $OUT (default /tmp/dtnode-gpu). SKIP names steps to leave out.
#
#     OUT=/tmp/gpu bash tests/bench/gpu.sh
#     SKIP="codecs throughput" bash tests/bench/gpu.sh
set -u
OUT=${OUT:-/tmp/dtnode-gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: its output in $OUT/NAME.log, its tail here
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    if [[ " ${SKIP:-} " == *" $name "* ]]; then return; fi
    echo "=== $name: $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name: rc=$? in $((SECONDS - start)) s"
}

step env 60 bash -c "nvidia-smi -L; $PY -c 'import torch, hivemind, pydantic_settings, grpc, dtnode.daemon.cli; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), hivemind.__version__, grpc.__version__)'"
cat "$OUT/env.log"
step cuda-tests 170 "$PY" -m pytest tests/test_cuda.py tests/test_overlap.py -q -p no:cacheprovider -k "cuda or gpu or nccl"
tail -n 15 "$OUT/cuda-tests.log"
step codecs 90 "$PY" -m tests.bench.allreduce --coding-only --coding-device cuda
[[ -f "$OUT/codecs.log" ]] && tail -n 8 "$OUT/codecs.log"
step throughput 230 "$PY" -m tests.bench.throughput --steps 10 --warmup 3
tail -n 12 "$OUT/throughput.log"
step host-ranks 160 "$PY" -m tests.bench.host_ranks --device cuda --model small --batch-size 16 --seq-len 512 \
    --inner-steps 20 --rounds 4
tail -n 6 "$OUT/host-ranks.log"
