# Sourced by scripts/gpu_check.sh and scripts/gpu_store_bench.sh from the repository root, with
# PY, RESULTS_DIR, WHEEL_DIR and SITE set: installs any missing Python package from wheels
# beside the tree ($WHEEL_DIR) and pagekv itself into a private site dir (offline; the tree stays
# untouched), sets PYTHONPATH and writes the GPU's name to $RESULTS_DIR/gpu.txt.
mkdir -p "$SITE"
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

