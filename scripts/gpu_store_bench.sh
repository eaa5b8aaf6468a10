#!/usr/bin/env bash
# The store's figures on a GPU host (issue 29's table), in about 8 minutes, JSON into $OUT:
#   bench_store.json            streams 1 and 8 (one-stream GET/PUT and 8-stream GET against
#                               the K-stream TCP ceilings), user (put_many/get_many of 32 x 2 MiB,
#                               fresh buffers, against one TCP stream), rss (node RSS under the
#                               put stream, in capacities)
#   bench_connector.json        4 GiB prompt from 1 and 3 TCP nodes: prefetch GB/s (and against
#                               the 8-stream ceiling), write-back seconds
#   bench_connector_shm.json    the same from one --shm node: prefetch against 8-thread memcpy,
#                               write-back seconds
#   OUT=/tmp/out bash scripts/gpu_store_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/pagekv-store-bench}
RESULTS_DIR=$OUT
WHEEL_DIR=${WHEEL_DIR:-$ROOT/.whl}
SITE=${PAGEKV_SITE:-/tmp/pagekv-site}
mkdir -p "$OUT"
source scripts/gpu_env.sh  # pagekv and what is missing, from wheels; PYTHONPATH set

status=0
run() {  # run NAME ARGS...: scripts/NAME.py ARGS, its log beside its JSON
  local log="$OUT/$1.log"
  echo "== $*"
  $PY "scripts/$1.py" "${@:2}" 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
run bench_store --only streams,user,rss --streams 1,8 --paths bulk --skip-peers
run bench_connector --nodes 1,3
run bench_connector --nodes 1 --shm
echo "gpu_store_bench: status $status; results in $OUT"
exit $status
