#!/usr/bin/env bash
# The serving benchmark side by side on one GPU machine: a base checkout and this one, interleaved
# (base, this, base, this, ...), so that both see the same machine state; then the medians.
#   bash benchmarks/serving/bench_serving_ab.sh BASE_DIR PAIRS [bench_serving_gpu.py arguments]
# BASE_DIR holds another commit's tree (e.g. `mkdir .base && git archive <commit> | tar -x -C .base`,
# carried as an ignored path); its own benchmarks/ run its own code. Each run writes
# $dest/ab/<i>-<base|head>/serving_*.json; benchmarks/serving/ab_summary.py prints the medians.
# Carry .whl/ too (see gpu_env.sh).
set -uo pipefail
subject=serving
source "$(dirname "$0")/../gpu_env.sh"
base="$(realpath "$1")"
pairs="$2"
shift 2
head="$PWD"
site="${PYTHONPATH:-}"
for i in $(seq 1 "$pairs"); do
    for side in base head; do
        dir="$head"; [ "$side" = base ] && dir="$base"
        out="$dest/ab/$i-$side"
        mkdir -p "$out"
        echo "== pair $i: $side ($dir)"
        # the carried wheels stay on the path; the checkout's own radixrelay and benchmarks come first
        (cd "$dir" && PYTHONPATH="$dir:$site" python3 -m benchmarks.serving.bench_serving_gpu --out-dir "$out" "$@" \
            > "$out/log.txt" 2>&1) || echo "   failed: see $out/log.txt"
        tail -n 4 "$out/log.txt"
    done
done
python3 "$head/benchmarks/serving/ab_summary.py" "$dest/ab"
