set -u
export PAGEKV_COMMIT=24f81c1
ROOT=$PWD; PY=python3; WHEEL_DIR=$PWD/.whl; SITE=/tmp/pagekv-site; RESULTS_DIR=$OUT
python3 -m pip install -q --no-index --no-deps --target /tmp/pagekv-site .whl/xdist/*.whl
source scripts/gpu_env.sh >/dev/null
t0=$(date +%s)
$PY -c "from pagekv.kernels import calibrate; calibrate(0)" 2>&1 | tail -2
echo "calibrated in $(( $(date +%s) - t0 )) s"
timeout 300 $PY -m pytest -q -p no:cacheprovider -n 6 tests/gpu/test_copy_issuer_gpu.py tests/gpu/test_connector_copy_engine_gpu.py tests/gpu/test_streaming_load_gpu.py tests/gpu/test_pitched_gpu.py tests/gpu/test_split_gpu.py -W error::pytest.PytestUnhandledThreadExceptionWarning 2>&1 | tail -25 | tee $OUT/tests1.log
echo "tests done at $(( $(date +%s) - t0 )) s"
(cd scripts && timeout 200 $PY diag_issuer_overhead.py --by-layer --mib 32,256,1024 --spin-ms 0,20 --reps 5 2>&1 | tail -12 | tee $OUT/diag.log)
cp benchmarks/results/diag_issuer_by_layer.json $OUT/ 2>/dev/null; ls $OUT; find . -name "diag_issuer_by_layer*.json" -newer run1.sh | head
echo "all done at $(( $(date +%s) - t0 )) s"
