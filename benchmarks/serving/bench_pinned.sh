#!/usr/bin/env bash
# A pinned system prompt under memory pressure on a CUDA machine (benchmarks/serving/bench_pinned.py --help): the
# real server with Llama-3-8B shapes and dummy weights, pinned and unpinned runs of the same traffic.
#   bash benchmarks/serving/bench_pinned.sh [--agents 40] [--churn 8]
# Carry .whl/ (wheels and the default model's tokenizer: see gpu_env.sh).
# Results go to the folder named by $OUT if set (remote runs), else benchmarks/results/serving/.
set -uo pipefail
subject=serving
source "$(dirname "$0")/../gpu_env.sh"
python3 -m benchmarks.serving.bench_pinned --device cuda --out-dir "$dest" "$@" 2>&1 | tee "$dest/bench_pinned.log"
exit "${PIPESTATUS[0]}"
