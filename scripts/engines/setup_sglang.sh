#!/usr/bin/env bash
# Creates (or reuses) the SGLang 0.5.23 venv that `make test-sglang` runs in, outside the repo.
#
#   ${PAGEKV_ENGINE_VENVS:-$HOME/.cache/pagekv/venvs}/sglang-0.5.23
#
# A stamp file marks a complete install; it records a hash of the package list and the
# constraints file, so changing either rebuilds the venv. pagekv itself is NOT installed here: the Makefile target puts
# the checkout on PYTHONPATH, so one venv serves every checkout. Prints the venv's python.
#
# What goes in (engines.md section 1): the CPU torch wheel (local, pinned like the main venv),
# sglang==0.5.23 without its dependencies (they pull CUDA stacks and GBs), and the light
# packages its hicache_storage, storage backend factory and host pools import. The PyPI
# torchvision wheel does not load against CPU torch and is left out; the tests stub it.
set -euo pipefail

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
ROOT="${PAGEKV_ENGINE_VENVS:-$HOME/.cache/pagekv/venvs}"
VENV="$ROOT/sglang-$SGLANG_VERSION"
STAMP="$VENV/.pagekv-complete"
HERE="$(cd "$(dirname "$0")" && pwd)"
PACKAGES=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq
    tqdm ipython aiohttp triton xxhash msgpack
    transformers dill apache-tvm-ffi sentencepiece compressed_tensors gguf pytest pytest-asyncio)
WANT="$( (echo "$SGLANG_VERSION $TORCH_VERSION ${PACKAGES[*]}"; cat "$HERE/sglang-constraints.txt") \
    | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "$VENV/bin/python"
    exit 0
fi

log() { echo "[setup_sglang] $*" >&2; }
start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$ROOT"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$HERE/sglang-constraints.txt")

log "torch==$TORCH_VERSION (CPU wheel) and light packages"
"${PIP[@]}" "torch==$TORCH_VERSION" "${PACKAGES[@]}" >&2
# compressed_tensors or transformers may drag torchvision in; it cannot load on CPU torch.
"$VENV/bin/python" -m pip uninstall -q -y torchvision >&2 2>/dev/null || true

log "sglang==$SGLANG_VERSION --no-deps"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" >&2

# Only a venv that imports SGLang's HiCache storage API gets its stamp.
"$VENV/bin/python" -c "import sglang.srt.mem_cache.storage.backend_factory" >&2

echo "$WANT" > "$STAMP"
log "done in $(( $(date +%s) - start )) s: $VENV"
echo "$VENV/bin/python"
