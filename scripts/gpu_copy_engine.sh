#!/usr/bin/env bash
# One GPU-host call for issue 32 (copy engines), < 9 minutes (the steps' limits add up to 8.1
# minutes, plus the env setup),
# from the repository root:
#   1. the python env from wheels (scripts/gpu_env.sh) and the kernel build,
#   2. the measured copy table for this GPU (what backend="auto" picks), on an idle GPU,
#   3. the CUDA tests of the transfers: connector, engine contract, kernels, copy engine (JUnit;
#      cut at its limit by SIGINT, so pytest still prints the failures and writes the XML),
#   4. the ratio table: kernel, copy engine and auto's choice per shape, each with its host time
#      per call, and the copy engine's host time against its copy count (bench_copy_engine.py),
#   5. the reference engine beside 4 GiB layer-by-layer loads, with their enqueue time
#      (bench_beside_compute.py, engine part).
# Each step has its own time limit and log; results go to $RESULTS_DIR (default $OUT/ce, or
# benchmarks/results), then into one $OUT/ce.tgz when $OUT is set.
#   WHEEL_DIR=/path/to/.whl bash scripts/gpu_copy_engine.sh
# (TESTS= narrows step 3 to the files named, RATIO_ARGS= passes arguments to step 4)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
RESULTS_DIR=${RESULTS_DIR:-${OUT:+$OUT/ce}}
RESULTS_DIR=${RESULTS_DIR:-$ROOT/benchmarks/results}
WHEEL_DIR=${WHEEL_DIR:-$ROOT/.whl}
SITE=${PAGEKV_SITE:-/tmp/pagekv-site-ce}
PAGEKV_VENV=${PAGEKV_VENV:-/tmp/pagekv-venv-ce}
export PAGEKV_CACHE_DIR=${PAGEKV_CACHE_DIR:-/tmp/pagekv-cache-ce}
mkdir -p "$RESULTS_DIR"
source scripts/gpu_env.sh

status=0
step() {  # step NAME SECONDS CMD...: run with a limit (signal $SIG, default TERM), log to
  local name=$1 limit=$2 start rc  # $RESULTS_DIR/NAME.log
  shift 2
  start=$(date +%s)
  echo "== $name (limit ${limit}s)"
  timeout -s "${SIG:-TERM}" -k 15 "$limit" "$@" >"$RESULTS_DIR/$name.log" 2>&1
  rc=$?
  tail -n "${TAIL:-25}" "$RESULTS_DIR/$name.log"
  echo "== $name: rc $rc in $(($(date +%s) - start))s"
  [ "$rc" -eq 0 ] || status=1
}

step build 30 $PY -c "
from pagekv.kernels import copy_engine, jit
jit.load_library()
print('kernels:', jit.kernels_unavailable_reason() or 'ok', '| copy engine:',
      copy_engine.disabled_reason(0) or 'ok', copy_engine._support(0), '| streams', copy_engine.LANES)
"
# the table first, on an idle GPU: the tests and benchmarks below read it from the cache
step copy_table 45 $PY -c "
import json, os, pagekv.kernels as k
t = k.calibrate(0)
out = os.path.join(os.environ['RESULTS_DIR'], 'copy_table.json')
json.dump(t.to_json(), open(out, 'w'), indent=1)
for e in t.entries:
    s = e.shape
    print(('load' if s.load else 'save'), ('all' if s.all_layers else 'one'), int(s.run_bytes),
          s.total_bytes >> 20, 'MiB', {b: round(x * 1e3, 3) for b, x in e.seconds}, 'host us',
          {b: round(x * 1e6, 1) for b, x in e.enqueue}, '->', e.best(k.copy_table.BACKENDS),
          'issuer ->', e.best(k.copy_table.BACKENDS, deferred=True))
"
# pytest-xdist where the host has it; the kernels' reference and store tests in bf16 with int64
# indices only (~330 tests; their other dtypes exercise the kernels, unchanged here)
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8 --dist load")
SIG=INT TAIL=40 step tests 190 $PY -m pytest -q -rfE -p no:cacheprovider $XDIST \
  --junitxml="$RESULTS_DIR/tests.xml" \
  -k "not (match_reference or store_kv_matches) or (bfloat16 and i64)" \
  ${TESTS:-tests/gpu/test_copy_issuer_gpu.py tests/gpu/test_connector_copy_engine_gpu.py \
  tests/gpu/test_streaming_load_gpu.py tests/gpu/test_engine_contract_gpu.py \
  tests/test_kernels_copy_engine.py tests/test_transfer_indices.py tests/gpu/test_kernels_gpu.py \
  tests/gpu/test_pitched_gpu.py tests/test_engine_gpu.py}
TAIL=40 step ratio_table 110 $PY scripts/bench_copy_engine.py ${RATIO_ARGS:-}
TAIL=30 step beside 110 $PY scripts/bench_beside_compute.py --skip-decode --engine-sizes 4 \
  --engine-pairs 3 --max-prefixes 8
echo "gpu_copy_engine: status $status"
if [ -n "${OUT:-}" ] && [ "$RESULTS_DIR" = "$OUT/ce" ]; then
  (cd "$OUT" && tar czf ce.tgz ce && rm -rf ce)
fi
exit $status
