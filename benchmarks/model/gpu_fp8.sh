#!/usr/bin/env bash
# FP8 on one H100 in one call: the FP8 GPU tests, the products alone (bench_fp8_gemm), the decode step
# worker-direct in bf16, FP8 weights and FP8 weights + KV (bench_throughput; its no-attention row is the
# model step the issue's 0.65x is about), then the real server in the three precisions.
#   bash benchmarks/model/gpu_fp8.sh            (carry .whl/; results in $OUT, else benchmarks/results/model/)
set -uo pipefail
subject=model
source "$(dirname "$0")/../gpu_env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/structured/*.whl 2>/dev/null
export PYTHONPATH="/tmp/site:$PWD"
rc=0
python3 -m pytest -m gpu -q -p no:cacheprovider tests/model/test_fp8_cuda.py tests/kernels/test_fp8_cache.py \
    tests/kernels/test_fp8_quant.py 2>&1 | tee "$dest/fp8_gpu_tests.log" | tail -5 || rc=1
timeout 240 python3 -m benchmarks.kernels.bench_fp8_gemm --out-dir "$dest" 2>&1 | tail -20 || rc=1
for precision in "" "--quantization fp8" "--quantization fp8 --kv-cache-dtype fp8"; do
    # shellcheck disable=SC2086
    timeout 240 python3 -m benchmarks.engine.bench_throughput --layers 32 --quick --only at \
        --modes cascade,no-attn --output 64 --warmup 8 --repeats 3 $precision --out-dir "$dest" 2>&1 \
        | grep "^| (" || rc=1
done
timeout 600 python3 -m benchmarks.serving.bench_serving_gpu --configs auto,auto-fp8,auto-fp8-fp8kv \
    --workloads shared-prefix,tree --rates 200 --num-requests 3000 --no-warmup --time-budget 540 \
    --tokenizer "$PWD/.whl/SmolLM2-135M-Instruct.tokenizer.gguf" --out-dir "$dest" 2>&1 | tail -20 || rc=1
exit $rc
