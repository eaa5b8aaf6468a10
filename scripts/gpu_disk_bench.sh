#!/usr/bin/env bash
# The disk tier's benchmarks on a GPU host's own disk (issue 30), from the repository root, in
# under 8 minutes: scripts/bench_disk.py (the tier against O_DIRECT reads of its files, index
# rebuild, a model replay) and scripts/bench_disk_node.py (through real nodes: memory hits with
# the tier on and off, disk GETs against the O_DIRECT sequential ceiling, a Zipf replay at 4x
# memory with and without the tier, a restart on 10 GiB). JSON, logs and the disk's facts
# (lsblk, findmnt) go to $OUT/disk. DISK_DIR: where the benchmarks write (default
# /tmp/pagekv-disk-bench, removed after); WHEEL_DIR: wheels for scripts/gpu_env.sh (default
# $MAIN/.whl, else ./.whl).
set -u
R=$OUT/disk
mkdir -p "$R"
ROOT=$PWD PY=${PY:-python3} RESULTS_DIR=$R SITE=/tmp/site-disk-bench PAGEKV_VENV=/tmp/venv-disk-bench
WHEEL_DIR=${WHEEL_DIR:-${MAIN:-$PWD}/.whl}
source scripts/gpu_env.sh
D=${DISK_DIR:-/tmp/pagekv-disk-bench}
mkdir -p "$D"
{ nproc; free -g | head -2; df -h "$D"; findmnt -T "$D"
  lsblk -o NAME,SIZE,ROTA,TYPE,MOUNTPOINT,MODEL | head -20; } 2>&1 | tee "$R/host.txt"
timeout 170 $PY scripts/bench_disk.py --dir "$D" --gib 4 --replay 2>&1 | tee "$R/bench_disk.log" | tail -12
timeout 270 $PY scripts/bench_disk_node.py --dir "$D" --memory-mib 2048 --replay-memory-mib 512 \
  --restart-gib 10 --rounds 5 2>&1 | tee "$R/bench_disk_node.log" | tail -8
rm -rf "$D"
