#!/usr/bin/env bash
# KV tiers on one H100 in one call: the tier GPU tests (~2.5 minutes), the loads by run length
# (bench_tier_loads, ~20 s), then the multi-turn chats with 4K histories in the configs given (default: host
# and off; each ~2 minutes, one server each: three configs approach a call's 10-minute limit).
#   bash benchmarks/tiers/gpu_tiers.sh [CONFIG ...]    (carry .whl/; results in $OUT, else benchmarks/results/tiers/)
set -uo pipefail
subject=tiers
source "$(dirname "$0")/../gpu_env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/structured/*.whl 2>/dev/null
export PYTHONPATH="/tmp/site:$PWD"
rc=0
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/worker tests/kernels/test_host_copy.py \
    tests/attention/test_host_staging.py tests/engine/test_engine_gpu.py 2>&1 \
    | tee "$dest/tiers_gpu_tests.log" | tail -5 || rc=1
timeout 120 python3 -m benchmarks.tiers.bench_tier_loads --out-dir "$dest" 2>&1 | tail -14 || rc=1
for config in "${@:-host off}"; do
    for c in $config; do
        timeout 220 python3 -m benchmarks.tiers.bench_kv_tiers_gpu --configs "$c" --out-dir "$dest" \
            > "$dest/kv_tiers_$c.log" 2>&1 || rc=1
        grep "^\[" "$dest/kv_tiers_$c.log" | tail -2
        grep -l Traceback "$dest"/server_*.log 2>/dev/null || rm -f "$dest"/server_*.log   # kept when a process died
    done
done
exit $rc
