# Sourced by scripts/gpu_check.sh and scripts/gpu_store_bench.sh from the repository root, with
# PY, RESULTS_DIR, WHEEL_DIR and SITE set: installs any missing Python package from wheels
# beside the tree ($WHEEL_DIR) into a private site dir, and pagekv itself (offline) into a
# virtualenv of its own layered over $PY's packages (torch and the rest come from there through
# a .pth file), so that its console script exists beside the interpreter the tests run
# (tests/cli_helpers.py). Sets PY to that interpreter, PATH and PYTHONPATH (the tree first: the
# tests import the sources they test), and writes the GPU's name to $RESULTS_DIR/gpu.txt.
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
  echo "gpu_env: missing here: $missing; installing from $WHEEL_DIR"
  ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1 || { echo "gpu_env: no wheels in $WHEEL_DIR"; exit 2; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEEL_DIR"/*.whl || exit 2
fi
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
