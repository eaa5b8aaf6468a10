#!/usr/bin/env bash
# One command for a GPU machine (no network; may lack pyzmq / pytest-asyncio):
#   1. installs pagekv and any missing Python package from wheels beside the tree (.whl/ or
#      $WHEEL_DIR) into a private site dir,
#   2. builds the CUDA kernels, runs the GPU tests (tests/gpu, marked cuda) and the rest of the
#      suite that can run there,
#   3. runs the kernel benchmark.
# Results (JUnit XML, logs, benchmark JSON) go to $RESULTS_DIR (default benchmarks/results).
#   RESULTS_DIR=/tmp/out BENCH="kernels" bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
RESULTS_DIR=${RESULTS_DIR:-$ROOT/benchmarks/results}
WHEEL_DIR=${WHEEL_DIR:-$ROOT/.whl}
SITE=${PAGEKV_SITE:-/tmp/pagekv-site}
BENCH=${BENCH:-kernels}
TESTS=${TESTS:-tests}
mkdir -p "$RESULTS_DIR" "$SITE"
export RESULTS_DIR PYTHONUNBUFFERED=1 PAGEKV_COMMIT=${PAGEKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

missing=$($PY - <<'PYEOF'
import importlib.util
need = {"zmq": "pyzmq", "msgpack": "msgpack", "xxhash": "xxhash", "pytest": "pytest",
        "pytest_asyncio": "pytest-asyncio", "numpy": "numpy", "torch": "torch"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "gpu_check: missing here: $missing; installing from $WHEEL_DIR"
  ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1 || { echo "gpu_check: no wheels in $WHEEL_DIR"; exit 2; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEEL_DIR"/*.whl || exit 2
fi
# pagekv itself, offline (setuptools is there); a wheel install keeps the tree untouched.
$PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
    --target "$SITE/pagekv-pkg" "$ROOT" || exit 2
export PYTHONPATH="$SITE/pagekv-pkg:$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$RESULTS_DIR/gpu.txt"
$PY -c "import torch, pagekv.kernels as k; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| kernels:', k.kernels_unavailable_reason() or 'ok')" | tee -a "$RESULTS_DIR/gpu.txt"

status=0
$PY -m pytest -q -p no:cacheprovider $TESTS --junitxml="$RESULTS_DIR/tests.xml" 2>&1 | tail -n 40 | tee "$RESULTS_DIR/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
for b in $BENCH; do
  echo "== bench_$b"
  $PY "scripts/bench_$b.py" ${BENCH_ARGS:-} 2>&1 | tee "$RESULTS_DIR/bench_$b.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
echo "gpu_check: status $status"
exit $status
