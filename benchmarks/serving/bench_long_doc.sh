#!/usr/bin/env bash
# A long document asked many questions on a CUDA machine (benchmarks/serving/bench_long_doc.py --help): the real
# server with Llama-3-8B shapes and dummy weights, documents of 2K-112K tokens, text and token-id prompts.
#   bash benchmarks/serving/bench_long_doc.sh [--lengths 2000,112000] [--profile 112000]
# Carry .whl/ (wheels and the default model's tokenizer: see gpu_env.sh; py-spy's wheel there enables --profile).
# Results go to the folder named by $OUT if set (remote runs), else benchmarks/results/serving/.
set -uo pipefail
subject=serving
source "$(dirname "$0")/../gpu_env.sh"
python3 -m benchmarks.serving.bench_long_doc --device cuda --out-dir "$dest" "$@" 2>&1 | tee "$dest/bench_long_doc.log"
exit "${PIPESTATUS[0]}"
