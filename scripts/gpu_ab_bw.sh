#!/usr/bin/env bash
# DIAG A/B ONLY (issue 29's bandwidth rows; delete with PAGEKV_DIAG_AB_BASE): this tree (arm B)
# against the same tree with PAGEKV_DIAG_AB_BASE=1 (arm A: main e69e494's in-place lane
# receive, PUT hashing with the loop waiting for the pool, a client's ZeroMQ I/O threads =
# its streams, default streams one per 4 cores per node), rounds interleaved (B A, A B, B A) in
# one run, and scripts/diag_put.py first; at most ~8.5 minutes on the 16-core host. Into
# $OUT: ab_summary.txt (A against B per figure),
# ab.log, ab.tgz (every JSON and log).
#   OUT=/tmp/out WHEEL_DIR=/path/to/.whl bash scripts/gpu_ab_bw.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/pagekv-ab}
R=$OUT/ab
RESULTS_DIR=$R
WHEEL_DIR=${WHEEL_DIR:-$ROOT/.whl}
SITE=${PAGEKV_SITE:-/tmp/pagekv-site-ab}
export PAGEKV_VENV=${PAGEKV_VENV:-/tmp/pagekv-venv-ab}
mkdir -p "$R"
START=$SECONDS
{
source scripts/gpu_env.sh
nproc; free -g | head -2
run() {  # run ARM ROUND NAME SECONDS ARGS...
  local dir="$R/$3_$1_$2" base=0
  [ "$1" = A ] && base=1
  if [ $((SECONDS - START + $4)) -gt 500 ]; then echo "== skip $3 $1 round $2 (time)"; return; fi
  mkdir -p "$dir"; echo "== $3 arm $1 round $2 (t=$((SECONDS - START)) s)"
  PAGEKV_DIAG_AB_BASE=$base RESULTS_DIR=$dir timeout "$4" $PY "scripts/$3.py" "${@:5}" \
    > "$dir/log.txt" 2>&1
  echo "rc $?"; tail -4 "$dir/log.txt"
}
echo "== diag_put (t=$((SECONDS - START)) s)"; mkdir -p "$R/diag_put"
RESULTS_DIR=$R/diag_put timeout 60 $PY scripts/diag_put.py --rounds 3 2>&1 | tail -3
store=(--only headline,user,streams --streams 1,8 --paths bulk --skip-peers --rounds 4)
for round in 1 2 3; do
  arms="B A"; [ $round = 2 ] && arms="A B"
  for arm in $arms; do
    run $arm $round bench_store 100 "${store[@]}"
    [ $round -lt 3 ] && run $arm $round bench_connector 150 --nodes 1,3
  done
done
$PY - "$R" <<'PYEOF' | tee "$OUT/ab_summary.txt"
import json, pathlib, statistics, sys
root = pathlib.Path(sys.argv[1])
rows = {}  # (figure) -> {arm: [values]}
def add(name, arm, value):
    value = round(value, 3)
    rows.setdefault(name, {"A": [], "B": []})[arm].append(value)
for d in sorted(root.iterdir()):
    if not d.is_dir() or d.name.count("_") < 2:
        continue
    name, arm, _ = d.name.rsplit("_", 2)
    for f in d.glob("*.json"):
        j = json.loads(f.read_text())
        if name == "bench_store":
            h = j.get("headline", {}).get("median", {})
            for k in ("put_ratio", "get_ratio"):
                if k in h: add(f"headline 1-stream {k} (StoreClient)", arm, h[k])
            u = j.get("user", {}).get("median", {})
            for k, v in u.items():
                if "ratio" in k: add(f"user {k}", arm, v)
            for r in j.get("streams", {}).get("rows", []):
                for k in ("put_ratio", "get_ratio", "put_gbps", "get_gbps"):
                    add(f"streams {r['streams']} {k}", arm, r[k])
        else:
            for r in j.get("rows", []):
                for k in ("prefetch_gbps", "writeback_s", "raw_store_get_gbps",
                          "raw_async_get_gbps", "streams"):
                    add(f"connector {r['nodes']} node(s) {k}", arm, r[k])
print(f"{'figure':52s} {'A (base) values':28s} {'B (this) values':28s} B/A med")
for name, v in rows.items():
    a, b = v["A"], v["B"]
    ratio = statistics.median(b) / statistics.median(a) if a and b and statistics.median(a) else float("nan")
    print(f"{name:52s} {str(a):28s} {str(b):28s} {ratio:.3f}")
for f in (root / "diag_put").glob("*.json"):
    print("diag_put (arm B, 1-stream PUT vs raw ZeroMQ and TCP):", json.loads(f.read_text())["median"])
PYEOF
echo "total $((SECONDS - START)) s"
} 2>&1 | tee "$OUT/ab.log"
cd "$OUT" && tar czf ab.tgz ab && rm -rf ab
