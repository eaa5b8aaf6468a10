#!/usr/bin/env bash
# One command for a GPU machine (no network; may lack pyzmq / pytest-asyncio):
#   1. installs any missing Python package from wheels beside the tree (.whl/ or $WHEEL_DIR)
#      into a private site dir and pagekv into a virtualenv over python3's packages (its
#      console script included),
#   2. builds the CUDA kernels, runs the GPU tests (tests/gpu, marked cuda) and the rest of the
#      suite that can run there,
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
# pagekv itself, offline, into a virtualenv of its own layered over $PY's packages (torch and
# the rest come from there through a .pth file): the tests run the console script beside
# sys.executable (tests/cli_helpers.py), which a plain `pip --target` does not make. The tree
# stays first on PYTHONPATH, so the tests import the sources they test.
VENV=${PAGEKV_VENV:-/tmp/pagekv-venv}
$PY -m venv --without-pip --clear "$VENV" || exit 2
"$VENV/bin/python" - "$($PY -c 'import site; print(":".join(site.getsitepackages()))')" <<'PYEOF' || exit 2
import pathlib, sys, sysconfig
lines = [f"import site; site.addsitedir({p!r})" for p in sys.argv[1].split(":") if p]
pathlib.Path(sysconfig.get_paths()["purelib"], "_pagekv_parent_site.pth").write_text("\n".join(lines) + "\n")
PYEOF
"$VENV/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --upgrade "$ROOT" || exit 2
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# No network here: tests that need the package index skip and say so.
export PAGEKV_OFFLINE=${PAGEKV_OFFLINE:-1}
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
