#!/usr/bin/env bash
# GPU check + benchmark of the attention kernels, in one call on a CUDA machine:
#   1. every kernel test in tests/kernels, compiled (fp32 shapes) and the @pytest.mark.gpu ones at real
#      sizes in bf16;
#   2. benchmarks/kernels/bench_attention.py (arguments passed through, e.g. --quick, --sweep).
# Results (pytest log, markdown table) go to the folder named by $OUT if set (remote runs), else benchmarks/results/kernels/.
set -uo pipefail
subject=kernels
source "$(dirname "$0")/../gpu_env.sh"

python3 -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tee "$dest/pytest_gpu.log"
tests_rc=${PIPESTATUS[0]}

python3 -m benchmarks.kernels.bench_attention --out-dir "$dest" "$@" 2>&1 | tee "$dest/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "pytest exit $tests_rc, benchmark exit $bench_rc"
exit $(( tests_rc || bench_rc ))
