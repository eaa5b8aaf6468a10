#!/usr/bin/env bash
# Creates (or reuses) the SGLang 0.5.23 venv that `make test-sglang` runs in, outside the repo.
#
#   ${PAGEKV_ENGINE_VENVS:-$HOME/.cache/pagekv/venvs}/sglang-0.5.23
#
# A stamp file marks a complete install; it records a hash of the package list and the
# constraints file, so changing either rebuilds the venv. pagekv itself is not installed: the
# Makefile target puts the checkout on PYTHONPATH, so one venv serves every checkout; its
# runtime dependencies are (read from the checkout's pyproject.toml, see below).
# Prints the venv's python on stdout; everything else goes to stderr.
#
# What goes in (engines.md section 1): the CPU torch wheel (local, pinned like the main venv),
# sglang==0.5.23 without its dependencies (they pull CUDA stacks and GBs), and the light
# packages its cache modules (unified radix cache: openai, partial-json-parser) and its HTTP
# server path (fastapi ... soundfile; prometheus-client for --enable-metrics) import. The PyPI
# torchvision wheel does not load against CPU torch and is left out; the tests stub it.
set -euo pipefail

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
ROOT="${PAGEKV_ENGINE_VENVS:-$HOME/.cache/pagekv/venvs}"
VENV="$ROOT/sglang-$SGLANG_VERSION"
STAMP="$VENV/.pagekv-complete"
DEPS_STAMP="$VENV/.pagekv-deps"
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PACKAGES=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq
    tqdm ipython aiohttp triton xxhash msgpack
    transformers dill apache-tvm-ffi sentencepiece compressed_tensors gguf pytest pytest-asyncio pytest-timeout
    openai partial-json-parser
    fastapi uvicorn uvloop setproctitle python-multipart einops jsonschema xgrammar soundfile
    prometheus-client)
WANT="$( (echo "$SGLANG_VERSION $TORCH_VERSION ${PACKAGES[*]}"; cat "$HERE/sglang-constraints.txt") \
    | sha256sum | cut -c1-16)"

log() { echo "[setup_sglang] $*" >&2; }

# pip into the venv, pinned by the constraints file. sglang is installed without its (GPU)
# dependencies, so pip's resolver lists them as missing after every install: those lines go.
pip_install() {
    local status=0
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
        -c "$HERE/sglang-constraints.txt" "$@" > "$VENV/.pip.log" 2>&1 || status=$?
    grep -vE '^sglang [0-9.]+ requires|dependency resolver does not|dependency conflicts' \
        "$VENV/.pip.log" >&2 || true
    return "$status"
}

# pagekv's own runtime dependencies, read from this checkout's pyproject.toml (torch excluded:
# the CPU wheel above). They follow the checkout, so they have their own stamp and are topped
# up in place when they change, without rebuilding the venv.
install_pagekv_deps() {
    local deps
    deps="$("$VENV/bin/python" - "$REPO/pyproject.toml" <<'PY'
import sys, tomllib
from packaging.requirements import Requirement
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
wanted = project["dependencies"] + project["optional-dependencies"]["connector"]
reqs = [Requirement(r) for r in wanted]
print(" ".join(sorted(str(r) for r in reqs if r.name != "torch" and (r.marker is None or r.marker.evaluate()))))
PY
)"
    if [[ "$(cat "$DEPS_STAMP" 2>/dev/null)" != "$deps" ]]; then
        log "pagekv dependencies: $deps"
        # shellcheck disable=SC2086
        pip_install $deps
        echo "$deps" > "$DEPS_STAMP"
    fi
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    install_pagekv_deps
    echo "$VENV/bin/python"
    exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$ROOT"
python3 -m venv "$VENV"

log "torch==$TORCH_VERSION (CPU wheel) and light packages"
pip_install "torch==$TORCH_VERSION" "${PACKAGES[@]}"
# compressed_tensors or transformers may drag torchvision in; it cannot load on CPU torch.
"$VENV/bin/python" -m pip uninstall -q -y torchvision >&2 2>/dev/null || true

log "sglang==$SGLANG_VERSION --no-deps"
pip_install --no-deps "sglang==$SGLANG_VERSION"

# Only a venv that imports SGLang's HiCache storage API gets its stamp.
"$VENV/bin/python" -c "import sglang.srt.mem_cache.storage.backend_factory" >&2
install_pagekv_deps

echo "$WANT" > "$STAMP"
log "done in $(( $(date +%s) - start )) s: $VENV"
echo "$VENV/bin/python"
