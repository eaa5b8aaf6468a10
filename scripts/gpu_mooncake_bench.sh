#!/usr/bin/env bash
# Issue 31's Mooncake figure on a GPU host (no network), in a few minutes, JSON into $OUT:
#   mooncake.json   a 4 GiB prompt (Llama-3-8B geometry) prefetched cold by the connector
#                   through Mooncake Store (TCP) and through one pagekv node (TCP), and
#                   Mooncake's own batch_get_into of the same objects, one run
# Mooncake comes from a wheel beside the tree: $WHEEL_DIR/mooncake_transfer_engine_non_cuda-
# 0.3.13.post1-cpXY-...whl for this python (44 MiB), and, where the host lacks them, the RDMA
# verbs and NUMA libraries its libraries link (even over TCP) from $WHEEL_DIR/mooncake-libs/.
#   OUT=/tmp/out bash scripts/gpu_mooncake_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/pagekv-mooncake-bench}
RESULTS_DIR=$OUT
WHEEL_DIR=${WHEEL_DIR:-$ROOT/.whl}
SITE=${PAGEKV_SITE:-/tmp/pagekv-site}
mkdir -p "$OUT"
source scripts/gpu_env.sh  # pagekv and what is missing, from wheels; PYTHONPATH set

if ! $PY -c "import mooncake.store" 2>/dev/null; then
  tag=$($PY -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
  wheel=$(ls "$WHEEL_DIR"/mooncake_transfer_engine*-"$tag"-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] || { echo "gpu_mooncake_bench: no Mooncake wheel for $tag in $WHEEL_DIR"; exit 2; }
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$wheel" || exit 2
fi
MC=$($PY -c 'import importlib.util as u; print(list(u.find_spec("mooncake").submodule_search_locations)[0])')
chmod +x "$MC/mooncake_master" "$MC/mooncake_client" 2>/dev/null || true
for lib in libibverbs.so.1 libnuma.so.1; do
  if ! ldconfig -p | grep -q "$lib "; then
    echo "gpu_mooncake_bench: $lib not on this host: using $WHEEL_DIR/mooncake-libs"
    export LD_LIBRARY_PATH="$WHEEL_DIR/mooncake-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    break
  fi
done
$PY -c "from mooncake.store import MooncakeDistributedStore as M; M()" || exit 2
nproc; free -g | head -2
$PY scripts/bench_mooncake.py --bytes "${BYTES:-4GiB}" --rounds 5 2>&1 \
  | grep -v '^[IWE][0-9]\{4\} ' | tee "$OUT/bench_mooncake.log"
status=${PIPESTATUS[0]}
echo "gpu_mooncake_bench: status $status; results in $OUT"
exit "$status"
