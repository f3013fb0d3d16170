#!/usr/bin/env bash
# GPU check + end-to-end benchmark of cascaded attention, in one call on a CUDA machine:
#   1. tests/cascade/test_gpu.py (bf16 exactness against float64, CUDA graphs equal to eager) and the
#      planner tests;
#   2. benchmarks/bench_throughput.py (arguments passed through, e.g. --quick, --layers 8), under a time
#      limit of BENCH_SECONDS (default 420): rows are written as they finish.
# Results (pytest log, markdown table, log) go to $OUT if set (device tool), else benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
dest="${OUT:-benchmarks/results}"
mkdir -p "$dest"
export PYTHONUNBUFFERED=1
# radixrelay imports msgspec; a bare GPU image may lack it: install a carried wheel (.whl/)
if ! python3 -c 'import msgspec' 2>/dev/null && ls .whl/msgspec-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/msgspec-*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

python3 -m pytest tests/cascade/test_gpu.py tests/cascade/test_planner.py -q -p no:cacheprovider 2>&1 \
    | tee "$dest/pytest_cascade_gpu.log"
tests_rc=${PIPESTATUS[0]}

timeout "${BENCH_SECONDS:-420}" python3 benchmarks/bench_throughput.py --out-dir "$dest" "$@" 2>&1 \
    | tee "$dest/bench_throughput.log"
bench_rc=${PIPESTATUS[0]}

echo "pytest exit $tests_rc, benchmark exit $bench_rc"
exit $(( tests_rc || bench_rc ))
