#!/usr/bin/env bash
# Swarm drills: real node processes on loopback, in the swarms users run, then every node's log
# read for round lines, warnings, errors and tracebacks, and the θ_g hashes per round (marked
# where the nodes differ). Not a test (nothing is asserted): the reader judges the logs. About
# 5-8 minutes each on 2 cores.
#
#   bash tests/bench/drills.sh uneven          # `small`; a 2-rank host, a host with twice the batch,
#                                              # a host 2x slower; groups of 2; a late joiner; one host
#                                              # paused 40 s (SIGSTOP), one killed -9 and restarted
#   bash tests/bench/drills.sh overlap-shard   # --overlap; a --shard 2-rank host whose rank is
#                                              # killed -9 (the host exits, and is started again)
#   bash tests/bench/drills.sh sparse          # --compression sparse; groups of 2; a --client-mode
#                                              # host; a late joiner; a graceful restart
#
# Logs: $OUT (default /tmp/drill-SCENARIO), one file per node. DRILL_FLAGS adds flags to every
# node (DRILL_FLAGS="--sparse-top-k 128" bash tests/bench/drills.sh sparse).
set -u
cd "$(dirname "$0")/../.."
SCENARIO=${1:?scenario: uneven, overlap-shard or sparse}
D=${OUT:-/tmp/drill-$SCENARIO}
rm -rf "$D"
mkdir -p "$D"
DT=".venv/bin/dtnode"
COMMON=(--host 127.0.0.1 --dht-port 0 --grpc-port 0 --http-port 0 --model small --seq-len 128 --inner-steps 10
  --heartbeat-interval 2 --peer-ttl 10 --matchmaking-window 8 --checkpoint-every 1 --threads-per-rank 1)
case $SCENARIO in
  uneven) COMMON+=(--target-group-size 2) ;;
  overlap-shard) COMMON+=(--overlap) ;;
  sparse) COMMON+=(--compression sparse --target-group-size 2 --batch-size 4) ;;
  *) echo "unknown scenario $SCENARIO" >&2; exit 2 ;;
esac
read -r -a EXTRA <<<"${DRILL_FLAGS:-}"
COMMON+=("${EXTRA[@]}")

start() { # NAME [flags...]: a node in the background, its log in $D/NAME.log
  local name=$1
  shift
  mkdir -p "$D/$name"
  ( exec "$DT" join "${COMMON[@]}" --state-dir "$D/$name" "$@" >>"$D/$name.log" 2>&1 ) &
  echo $! >"$D/$name.pid"
}
pid() { cat "$D/$1.pid"; }
say() { echo "$(date +%T) $*"; }
wait_exit() { for _ in $(seq 1 60); do kill -0 "$(pid "$1")" 2>/dev/null || return 0; sleep 1; done; return 1; }

case $SCENARIO in
  uneven) start n1 --new-swarm --batch-size 4 --nproc-per-node 2 ;;
  overlap-shard) start n1 --new-swarm --batch-size 4 --nproc-per-node 2 --shard ;;
  sparse) start n1 --new-swarm ;;
esac
for _ in $(seq 1 120); do
  ADDR=$(grep -oP 'dtnode join --peer \K\S+' "$D/n1.log" | head -1)
  [ -n "$ADDR" ] && break
  sleep 1
done
say "swarm at $ADDR"

case $SCENARIO in
  uneven)
    start n2 --peer "$ADDR" --batch-size 8
    DTNODE_TEST_SLOW_INNER=2 start n3 --peer "$ADDR" --batch-size 4
    sleep 150
    say "late joiner n4"; start n4 --peer "$ADDR" --batch-size 4
    sleep 60
    say "SIGSTOP n3"; kill -STOP "$(pid n3)"; sleep 40; kill -CONT "$(pid n3)"; say "SIGCONT n3"
    sleep 60
    say "kill -9 n2"; kill -9 "$(pid n2)"; sleep 10
    start n2 --peer "$ADDR" --batch-size 8; say "n2 restarted"
    sleep 150
    ;;
  overlap-shard)
    start n2 --peer "$ADDR" --batch-size 8
    DTNODE_TEST_SLOW_INNER=2 start n3 --peer "$ADDR" --batch-size 4
    sleep 170
    child=$(pgrep -P "$(pid n1)" -f rank_process | head -1)
    say "kill -9 of n1's local rank $child"; kill -9 "$child"
    if wait_exit n1; then
      say "n1 exited; started again"; start n1 --peer "$ADDR" --batch-size 4 --nproc-per-node 2 --shard
    else
      say "n1 did not exit"
    fi
    sleep 150
    ;;
  sparse)
    start n2 --peer "$ADDR"
    start n3 --peer "$ADDR" --client-mode
    sleep 120
    say "late joiner n4"; start n4 --peer "$ADDR"
    sleep 90
    say "SIGTERM n2"; kill -TERM "$(pid n2)"; wait_exit n2
    start n2 --peer "$ADDR"; say "n2 restarted"
    sleep 120
    ;;
esac

say "stopping every node"
for f in "$D"/n*.pid; do kill -TERM "$(cat "$f")" 2>/dev/null; done
for f in "$D"/n*.pid; do wait_exit "$(basename "$f" .pid)" || say "$(basename "$f" .pid) still running"; done
for log in "$D"/n*.log; do
  echo "== $(basename "$log" .log)"
  grep -E "round [0-9]+ \||WARN|ERROR|Traceback|applied the last|took the swarm|stopped at" "$log" |
    grep -v "no swarm key\|loopback address" | cut -c1-250
done
echo "tracebacks: $(cat "$D"/n*.log | grep -c Traceback)"
# θ_g agreement: the hashes the nodes printed for each round (one per round when they agree)
echo "θ_g hashes per round (nodes that printed each):"
for log in "$D"/n*.log; do
  grep -oP 'dtnode: round \K\d+ \|.*params \w+' "$log" | sed -E "s/^([0-9]+) \|.*params (\w+)$/\1 \2 $(basename "$log" .log)/"
done | sort -k1,1n -k2,2 | awk '
  { key = $1 " " $2; if (!(key in who)) { order[++n] = key }; who[key] = who[key] " " $3 }
  END { for (i = 1; i <= n; i++) { split(order[i], k, " "); count[k[1]]++ }
        for (i = 1; i <= n; i++) { split(order[i], k, " ");
          printf "  round %s %s:%s%s\n", k[1], k[2], who[order[i]], (count[k[1]] > 1 ? "   <- differs" : "") } }'
