#!/usr/bin/env bash
# Every GPU test, then the end-to-end throughput benchmark, in one call on a CUDA machine.
#   bash benchmarks/engine/gpu_all.sh [bench_throughput.py arguments]
# Carry .whl/ (see gpu_env.sh).
# Results go to the folder named by $OUT if set (remote runs), else benchmarks/results/engine/.
set -uo pipefail
subject=engine
source "$(dirname "$0")/../gpu_env.sh"
# (test_fused_ops.py and test_decode_rows.py carry no gpu mark: on a CUDA machine all of it runs on the device)
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_ops.py tests/kernels/test_decode_rows.py \
    && python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels tests/cascade/test_gpu.py \
    tests/model/test_cuda.py tests/worker/test_sampling.py tests/worker/test_piecewise_graphs.py \
    tests/engine/test_engine_gpu.py tests/worker/test_kv_tiers_store.py 2>&1 | tee "$dest/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout "${BENCH_SECONDS:-360}" python3 -m benchmarks.engine.bench_throughput --out-dir "$dest" "$@" 2>&1 \
    | tee "$dest/bench_throughput.log"
bench_rc=${PIPESTATUS[0]}
echo "pytest exit $tests_rc, benchmark exit $bench_rc"
exit $(( tests_rc || bench_rc ))
