#!/usr/bin/env bash
# Structured outputs on a CUDA machine: the GPU tests (with the runtime's other GPU tests the worker
# change touches), then bench_structured.py on Llama-3-8B shapes with dummy weights.
#   bash benchmarks/structured/gpu_structured.sh
# Carry .whl/ (see gpu_env.sh) with .whl/structured/: xgrammar and what it imports that a bare GPU
# image lacks (apache-tvm-ffi, transformers and its dependencies), fetched with the command in
# gpu_env.sh for: xgrammar apache-tvm-ffi transformers huggingface_hub hf-xet regex pyyaml safetensors
# tqdm requests urllib3 idna certifi charset_normalizer filelock fsspec packaging typer click
# shellingham rich markdown-it-py mdurl pygments httpx2 httpcore2 anyio truststore h11 sniffio
# "tokenizers>=0.23.1,<0.24" typing_extensions jsonschema jsonschema-specifications referencing
# rpds-py attrs.
set -uo pipefail
subject=structured
source "$(dirname "$0")/../gpu_env.sh"
if ls .whl/structured/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/structured/*.whl
fi
python3 -c 'import xgrammar, transformers; print("xgrammar ok, transformers", transformers.__version__)'
python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_structured_gpu.py tests/engine/test_engine_gpu.py \
    tests/worker/test_sampling.py tests/worker/test_piecewise_graphs.py 2>&1 | tee "$dest/gpu_structured_tests.log"
tests_rc=${PIPESTATUS[0]}
tokenizer=.whl/SmolLM2-135M-Instruct.tokenizer.gguf
timeout "${BENCH_SECONDS:-360}" python3 -m benchmarks.structured.bench_structured --device cuda --llama3-8b --tokenizer "$tokenizer" \
    --batch 64 --max-tokens 128 --repeats 3 --output "$dest/structured_outputs_gpu.md" 2>&1 | tail -20
bench_rc=${PIPESTATUS[0]}
echo "pytest exit $tests_rc, benchmark exit $bench_rc"
exit $(( tests_rc || bench_rc ))
