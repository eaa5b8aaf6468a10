#!/usr/bin/env bash
# The store's figures on a GPU host (issue 29's table, docs/benchmarks.md), in about 5 minutes:
# ROUNDS (3) interleaved rounds of
#   bench_store        streams 1 and 8 (one-stream GET/PUT and 8-stream GET against the
#                      K-stream TCP ceilings; one stream with senders and receivers on
#                      cores of their own, the same for the ceilings as for pagekv), user
#                      (put_many/get_many of 32 x 2 MiB, fresh buffers, against one TCP
#                      stream), rss (node RSS under the put stream)
#   bench_connector    4 GiB prompt from 1 and 3 TCP nodes: prefetch GB/s, write-back seconds
#   bench_connector    the same from one --shm node (prefetch against 8-thread memcpy)
# then bench_put_ceiling once (one-stream PUT beside raw ZeroMQ and the TCP ceilings).
# Each figure is the median of its rounds (the host drifts between minutes: one round is not a
# figure). Into $OUT: summary.txt (each figure's rounds, median and target), run.log, results.tgz
# (every JSON and log, one folder per run).
#   OUT=/tmp/out bash scripts/gpu_store_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/pagekv-store-bench}
R=$OUT/results
RESULTS_DIR=$R
WHEEL_DIR=${WHEEL_DIR:-$ROOT/.whl}
SITE=${PAGEKV_SITE:-/tmp/pagekv-site}
ROUNDS=${ROUNDS:-3}
BUDGET_S=${BUDGET_S:-480}  # a run that could end past this is skipped (and said so)
mkdir -p "$R"
START=$SECONDS
status=0
{
source scripts/gpu_env.sh  # pagekv and what is missing, from wheels; PYTHONPATH set
nproc
run() {  # run DIR SECONDS NAME ARGS...: scripts/NAME.py ARGS, its JSON and log into R/DIR
  local dir="$R/$1"
  if [ $((SECONDS - START + $2)) -gt "$BUDGET_S" ]; then echo "== skip $1 (time)"; return; fi
  mkdir -p "$dir"; echo "== $1 (t=$((SECONDS - START)) s)"
  RESULTS_DIR=$dir timeout "$2" $PY "scripts/$3.py" "${@:4}" > "$dir/log.txt" 2>&1
  local rc=$?
  echo "rc $rc"; tail -3 "$dir/log.txt"
  [ $rc -eq 0 ] || status=1
}
for round in $(seq "$ROUNDS"); do
  run "store_$round" 120 bench_store --only streams,user,rss --streams 1,8 --paths bulk \
    --skip-peers --rounds 4
  run "connector_$round" 100 bench_connector --nodes 1,3
  run "connector_shm_$round" 80 bench_connector --nodes 1 --shm
done
run put_ceiling 60 bench_put_ceiling --rounds 3
$PY - "$R" <<'PYEOF' | tee "$OUT/summary.txt"
import json, pathlib, statistics, sys
root = pathlib.Path(sys.argv[1])
rows: dict[str, list[float]] = {}
pinned, pinned_streams = None, set()
targets: dict[str, tuple[str, float]] = {}
def add(name, value, target=None):  # target: (">=" or "<=", bound), or None for a side figure
    rows.setdefault(name, []).append(round(value, 3))
    if target:
        targets[name] = target
for d in sorted(root.iterdir()):
    for f in sorted(d.glob("*.json")):
        j = json.loads(f.read_text())
        if f.stem == "bench_store":
            pinned = j.get("streams", {}).get("pinned")
            for r in j.get("streams", {}).get("rows", []):
                k = r["streams"]
                if r.get("pinned"):
                    pinned_streams.add(k)
                add(f"{k}-stream GET / hot ceiling", r["get_ratio"], (">=", 0.85 if k == 1 else 0.7))
                add(f"{k}-stream PUT / hot ceiling", r["put_ratio"], (">=", 0.8) if k == 1 else None)
            for k, v in j.get("user", {}).get("median", {}).items():
                if "ratio" in k:
                    add(f"user 32 x 2 MiB {k}", v, (">=", 0.8))
            if "rss" in j:
                add("node RSS peak / capacity", j["rss"]["peak_over_capacity"], ("<=", 1.10))
        elif f.stem == "bench_connector":
            for r in j["rows"]:
                n = r["nodes"]
                add(f"prefetch {n} TCP node(s) GB/s", r["prefetch_gbps"], (">=", 14 if n == 1 else 16))
                add(f"write-back {n} TCP node(s) s", r["writeback_s"], ("<=", 0.5) if n == 3 else None)
        elif f.stem == "bench_connector_shm":
            for r in j["rows"]:
                add("prefetch --shm / 8-thread memcpy at start", r["prefetch_vs_memcpy8"])
                add("prefetch --shm / memcpy before each round", r["prefetch_vs_memcpy8_paired"], (">=", 0.85))
                add("write-back --shm s", r["writeback_s"], ("<=", 0.6))
        else:
            print(f"{f.stem}: {json.dumps(j.get('median'))}")
print(f"streams {sorted(pinned_streams)}: senders and receivers on CPUs {pinned}"
      if pinned_streams else "streams: unpinned")
print(f"{'figure':44s} {'median':>7s}  target  met  rounds")
for name, values in sorted(rows.items()):
    med = statistics.median(values)
    op, bound = targets.get(name, ("", None))
    met = "" if bound is None else ("yes" if (med >= bound if op == ">=" else med <= bound) else "NO")
    goal = "" if bound is None else f"{op} {bound}"
    print(f"{name:44s} {med:7.3f}  {goal:7s} {met:4s} {values}")
PYEOF
echo "total $((SECONDS - START)) s; status $status"
} > >(tee "$OUT/run.log") 2>&1
wait ${!:-} 2>/dev/null || true  # tee has written everything
cd "$OUT" && tar czf results.tgz results && rm -rf results
exit $status
