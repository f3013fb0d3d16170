#!/usr/bin/env bash
# Serving end to end on a CUDA machine (benchmarks/serving/bench_serving_gpu.py --help): the real server with
# Llama-3-8B shapes and dummy weights under shared-prefix, tree, TTFT-probe and multi-turn traffic,
# for cascade auto/off x overlap on/off; about 8 minutes on an H100 (--time-budget caps it).
#   bash benchmarks/serving/bench_serving_gpu.sh [--quick] [--configs auto,off] [--rates 16,48]
# Carry .whl/ (wheels and the default model's tokenizer: see gpu_env.sh).
# Results go to the folder named by $OUT if set (remote runs), else benchmarks/results/serving/.
set -uo pipefail
subject=serving
source "$(dirname "$0")/../gpu_env.sh"
python3 -m benchmarks.serving.bench_serving_gpu --out-dir "$dest" "$@" 2>&1 | tee "$dest/bench_serving_gpu.log"
exit "${PIPESTATUS[0]}"
