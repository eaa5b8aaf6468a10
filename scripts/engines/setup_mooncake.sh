#!/usr/bin/env bash
# Creates (or reuses) the Mooncake Store venv that `make test-mooncake` runs in, outside the repo.
#
#   ${PAGEKV_ENGINE_VENVS:-$HOME/.cache/pagekv/venvs}/mooncake-0.3.13.post1
#
# What goes in: Mooncake's Python client and binaries (mooncake_master, mooncake_client) from
# the non-CUDA wheel `mooncake-transfer-engine-non-cuda` (46 MB), the CPU torch wheel (local,
# pinned like the main venv) and pagekv's runtime and test dependencies. pagekv itself is not
# installed: the Makefile puts the checkout on PYTHONPATH, so one venv serves every checkout.
#
# The wheel's libraries link libibverbs.so.1 (the RDMA transport, loaded even in TCP mode); it
# comes from Debian's libibverbs1, installed here when missing. The non-CUDA build needs no
# libcuda; if only the CUDA build were available (MOONCAKE_PACKAGE=mooncake-transfer-engine), a
# stub libcuda.so.1 whose every call reports "no device" is built at setup (as
# ../shared/peers/setup.sh does) and named by $VENV/mooncake-env.sh.
#
# A stamp marks a complete install (a hash of the package list); a different list rebuilds.
# Prints the venv's python on stdout; everything else goes to stderr. Nothing downloads at run
# time. Cold: ~40 s on an idle 2-core box (torch from pip's cache); warm: a second.
#
#   setup_mooncake.sh --into VENV   adds only Mooncake's package (no dependencies: aiohttp,
#                                   requests, msgpack are there) to an engine's venv, so that
#                                   `make test-vllm` / `make test-sglang` run their adapters
#                                   against a Mooncake Store too; its own stamp, nothing rebuilt.
set -euo pipefail
exec 3>&1 1>&2  # fd 3: the answer

MOONCAKE_VERSION=0.3.13.post1
MOONCAKE_PACKAGE=${MOONCAKE_PACKAGE:-mooncake-transfer-engine-non-cuda}
TORCH_VERSION=2.13.0
PACKAGES=("$MOONCAKE_PACKAGE==$MOONCAKE_VERSION" "torch==$TORCH_VERSION" numpy pyzmq msgpack
    xxhash prometheus_client pytest pytest-asyncio pytest-timeout)
ROOT="${PAGEKV_ENGINE_VENVS:-$HOME/.cache/pagekv/venvs}"
VENV="$ROOT/mooncake-$MOONCAKE_VERSION"
STAMP="$VENV/.pagekv-complete"
WANT="$(echo "${PACKAGES[*]}" | sha256sum | cut -c1-16)"

log() { echo "[setup_mooncake] $*"; }

# libibverbs.so.1: the wheel's store.so, engine.so and mooncake_master link it.
if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then
    log "installing libibverbs1 (Debian)"
    apt-get install -y -qq libibverbs1 >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; }
fi

if [[ "${1:-}" == "--into" ]]; then
    INTO="$2"
    INTO_STAMP="$INTO/.pagekv-mooncake"
    if [[ "$(cat "$INTO_STAMP" 2>/dev/null)" != "$MOONCAKE_PACKAGE==$MOONCAKE_VERSION" ]]; then
        log "adding $MOONCAKE_PACKAGE==$MOONCAKE_VERSION to $INTO"
        "$INTO/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
            "$MOONCAKE_PACKAGE==$MOONCAKE_VERSION"
        "$INTO/bin/python" -c "from mooncake.store import MooncakeDistributedStore as M; M()"
        echo "$MOONCAKE_PACKAGE==$MOONCAKE_VERSION" > "$INTO_STAMP"
    fi
    echo "$INTO/bin/python" >&3
    exit 0
fi

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "$VENV/bin/python" >&3
    exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$ROOT"
python3 -m venv "$VENV"
log "installing ${PACKAGES[*]}"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PACKAGES[@]}" 2>&1 \
    | grep -v '^WARNING: Location' || true

# Only the CUDA build links libcuda.so.1: without a driver, a stub that reports "no device".
MC="$("$VENV/bin/python" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("mooncake").origin))')"
: > "$VENV/mooncake-env.sh"
if ldd "$MC/store.so" | grep -q 'libcuda.so.1 => not found'; then
    log "building a stub libcuda.so.1 (no NVIDIA driver here)"
    mkdir -p "$VENV/cudastub"
    syms=$(nm -D --undefined-only "$MC/store.so" "$MC/engine.so" | awk '{print $2}' \
        | grep -E '^cu[A-Z]' | sort -u)
    { echo '#include <stddef.h>'
      for s in $syms; do
        case $s in
          cuGetErrorString|cuGetErrorName)
            echo "int $s(int e, const char** p){ if(p) *p=\"no CUDA device\"; return 0; }";;
          *) echo "int $s(){ return 100; /* CUDA_ERROR_NO_DEVICE */ }";;
        esac
      done; } > "$VENV/cudastub/stub.c"
    gcc -shared -fPIC -o "$VENV/cudastub/libcuda.so.1" "$VENV/cudastub/stub.c" \
        -Wl,-soname,libcuda.so.1
    echo "export LD_LIBRARY_PATH=\"$VENV/cudastub\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\"" \
        > "$VENV/mooncake-env.sh"
fi

# Only a venv whose client loads and whose master starts gets its stamp.
# shellcheck disable=SC1091
( source "$VENV/mooncake-env.sh"
  "$VENV/bin/python" -c "from mooncake.store import MooncakeDistributedStore; MooncakeDistributedStore()"
  if ldd "$MC/mooncake_master" | grep 'not found'; then exit 1; fi )

echo "$WANT" > "$STAMP"
log "done in $(( $(date +%s) - start )) s: $VENV ($(du -sh "$VENV" | cut -f1))"
echo "$VENV/bin/python" >&3
