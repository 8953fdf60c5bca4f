#!/usr/bin/env bash
# The GPU checks of one device session, in order of value, each under its own time limit so that
# one failure leaves the others' figures: the CUDA tests, the codecs on the device, the swarm tests
# with every node on the GPU, the trainer's throughput (bf16, compile), a CUDA node in a real
# two-host swarm. Needs a CUDA torch and dtnode's
# dependencies on PYTHONPATH (tests/bench/gpu_wheels.sh makes them wheels for a machine without a
# package index); logs go to $OUT (default /tmp/dtnode-gpu). SKIP names steps to leave out.
#
#     OUT=/tmp/gpu bash tests/bench/gpu.sh
#     SKIP="codecs throughput" bash tests/bench/gpu.sh
#     SKIP="env codecs throughput host-ranks" CUDA_TESTS=restored WORKERS=12 bash tests/bench/gpu.sh
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
step cuda-tests 170 "$PY" -m pytest tests/test_cuda.py tests/test_overlap.py -q -p no:cacheprovider \
    -k "${CUDA_TESTS:-cuda or gpu or nccl}"
tail -n 15 "$OUT/cuda-tests.log"
step codecs 90 "$PY" -m tests.bench.allreduce --coding-only --coding-device cuda
[[ -f "$OUT/codecs.log" ]] && tail -n 8 "$OUT/codecs.log"
# The swarm tests (default suite and long_swarms) with every node on the GPU: their flags leave
# --device at auto, which takes CUDA where there is one. Several swarms share the one GPU.
SWARMS=${SWARMS:-"tests/test_sparse_swarm.py tests/test_moshpit_swarm.py tests/test_swarm.py tests/test_rounds.py
    tests/test_joining.py tests/test_overlap.py tests/test_checkpoint.py tests/test_failpoints.py"}
mkdir -p "$OUT/node-logs"
# shellcheck disable=SC2086
step swarm-tests "${SWARM_S:-300}" env OMP_NUM_THREADS=2 DTNODE_TEST_LOG_DIR="$OUT/node-logs" "$PY" -m pytest $SWARMS \
    -v -p no:cacheprovider -n "${WORKERS:-10}" --timeout 200 -m "not soak and not bench and not chaos_full and not multi_rank"
echo "passed: $(grep -c ' PASSED ' "$OUT/swarm-tests.log"), not passed:"
grep -E ' (FAILED|ERROR|SKIPPED) ' "$OUT/swarm-tests.log"
tail -n 3 "$OUT/swarm-tests.log"
echo "node logs: $(find "$OUT/node-logs" -name '*.log' | wc -l), with a traceback: $(grep -l Traceback "$OUT"/node-logs/*.log | wc -l)"
grep -l Traceback "$OUT"/node-logs/*.log | head -n 20
tar -C "$OUT" -czf "$OUT/node-logs.tgz" node-logs && rm -r "$OUT/node-logs"
step throughput 230 "$PY" -m tests.bench.throughput --steps 10 --warmup 3
tail -n 12 "$OUT/throughput.log"
step host-ranks 160 "$PY" -m tests.bench.host_ranks --device cuda --model small --batch-size 16 --seq-len 512 \
    --inner-steps 20 --rounds 4
tail -n 6 "$OUT/host-ranks.log"
