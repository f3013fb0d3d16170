#!/usr/bin/env bash
# GPU check + benchmark of the attention kernels, in one call on a CUDA machine:
#   1. every kernel test in tests/kernels, compiled (fp32 shapes) and the @pytest.mark.gpu ones at real
#      sizes in bf16;
#   2. benchmarks/bench_attention.py (arguments passed through, e.g. --quick, --sweep).
# Results (pytest log, markdown table) go to $OUT if set (device tool), else benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
dest="${OUT:-benchmarks/results}"
mkdir -p "$dest"
export PYTHONUNBUFFERED=1
# radixrelay/__init__ imports msgspec; a bare GPU image may lack it: install a carried wheel (.whl/)
if ! python3 -c 'import msgspec' 2>/dev/null && ls .whl/msgspec-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/msgspec-*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

python3 -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tee "$dest/pytest_gpu.log"
tests_rc=${PIPESTATUS[0]}

python3 benchmarks/bench_attention.py --out-dir "$dest" "$@" 2>&1 | tee "$dest/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "pytest exit $tests_rc, benchmark exit $bench_rc"
exit $(( tests_rc || bench_rc ))
