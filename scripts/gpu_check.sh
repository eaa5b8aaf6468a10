#!/usr/bin/env bash
# One command for a GPU machine (no network; may lack pyzmq / pytest-asyncio):
#   1. installs any missing Python package from wheels beside the tree (.whl/ or $WHEEL_DIR)
#      into a private site dir and pagekv into a virtualenv over python3's packages, its
#      console script included (scripts/gpu_env.sh),
#   2. builds the CUDA kernels, measures the transfer table with the host idle (once per
#      library and driver: cached; the tests' workers would share the host with it), runs the
#      GPU tests (tests/gpu, marked cuda) and the rest of the
#      suite that can run there (with -n in PYTEST_ADDOPTS, pytest-xdist, then the tests marked
#      gpu_alone on their own),
#   3. runs the kernel benchmark.
# Results (JUnit XML, logs, benchmark JSON) go to $RESULTS_DIR (default benchmarks/results).
#   RESULTS_DIR=/tmp/out BENCH="kernels" bash scripts/gpu_check.sh
#   TESTS="tests/gpu tests/test_cli.py" BENCH="" bash scripts/gpu_check.sh   # a subset, no bench
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
RESULTS_DIR=${RESULTS_DIR:-$ROOT/benchmarks/results}
WHEEL_DIR=${WHEEL_DIR:-$ROOT/.whl}
SITE=${PAGEKV_SITE:-/tmp/pagekv-site}
BENCH=${BENCH-kernels}
TESTS=${TESTS:-tests}
mkdir -p "$RESULTS_DIR"
source scripts/gpu_env.sh  # pagekv and what is missing, from wheels; PY, PATH, PYTHONPATH set

status=0
$PY -c "from pagekv.kernels import calibrate, kernels_unavailable_reason as why
print('copy table:', 'kernels unavailable' if why() else f'{len(calibrate(0).entries)} shapes')" \
  2>&1 | tee -a "$RESULTS_DIR/gpu.txt"
$PY -m pytest -q -p no:cacheprovider $TESTS --junitxml="$RESULTS_DIR/tests.xml" 2>&1 | tail -n 40 | tee "$RESULTS_DIR/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# pytest-xdist (-n in PYTEST_ADDOPTS) skips the tests that time the GPU (marked gpu_alone: the
# other workers' processes share it); they run here, alone (rc 5: none among $TESTS)
case " ${PYTEST_ADDOPTS:-} " in
  *" -n "* | *" -n"[0-9]* | *" --numprocesses"*)
    echo "== the tests that need the GPU alone"
    PYTEST_ADDOPTS="" $PY -m pytest -q -p no:cacheprovider -p no:xdist -m gpu_alone $TESTS \
      --junitxml="$RESULTS_DIR/tests_alone.xml" 2>&1 | tail -n 15 | tee "$RESULTS_DIR/tests_alone.log"
    case "${PIPESTATUS[0]}" in 0 | 5) ;; *) status=1 ;; esac
    ;;
esac
for b in $BENCH; do
  echo "== bench_$b"
  $PY "scripts/bench_$b.py" ${BENCH_ARGS:-} 2>&1 | tee "$RESULTS_DIR/bench_$b.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
echo "gpu_check: status $status"
exit $status
