#!/usr/bin/env bash
# Fills the ignored .whl/ that the GPU scripts carry to a bare GPU image (Python 3.12, x86_64; see
# gpu_env.sh): the server's and the benchmarks' wheels, .whl/structured (xgrammar and what it imports) and
# the default model's tokenizer; and the ignored .whl-fa3/ (FlashAttention-3's forward, for --node-kernel fa3
# and its tests), carried on its own. Run here, with the project's virtualenv set up (scripts/setup_env.sh) and PyPI reachable.
#   bash benchmarks/fetch_gpu_wheels.sh [base] [structured] [fa3] [tokenizer]     (default: all four)
# A device call carries at most 64 MiB: .whl is ~42 MiB, .whl-fa3 ~27 MiB (carry both only without
# .whl/structured). gpu_env.sh installs .whl/*.whl and .whl-fa3/*.whl where they are.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${RADIXRELAY_VENV:-.venv}/bin/python"
tags=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(base structured fa3 tokenizer)
for part in "${parts[@]}"; do
    case "$part" in
        base)
            "$py" -m pip download -q "${tags[@]}" "${platforms[@]}" -d .whl \
                fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.3 pydantic-core==2.50.4 \
                annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 \
                opentelemetry-api==1.45.2 msgspec==0.22.0 pyzmq==27.3.0 gguf==0.19.0 defusedxml==0.7.1 \
                redis==8.1.0 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 frozenlist==1.8.0 \
                aiosignal==1.4.0 aiohappyeyeballs==2.7.1 attrs==26.1.0 httptools==0.9.0 ;;
        structured)
            "$py" -m pip download -q "${tags[@]}" "${platforms[@]}" -d .whl/structured \
                xgrammar apache-tvm-ffi transformers huggingface_hub hf-xet regex pyyaml safetensors tqdm requests \
                urllib3 idna certifi charset_normalizer filelock fsspec packaging typer click shellingham rich \
                markdown-it-py mdurl pygments httpx2 httpcore2 anyio truststore h11 sniffio \
                "tokenizers>=0.23.1,<0.24" typing_extensions jsonschema jsonschema-specifications referencing \
                rpds-py attrs ;;
        fa3)    # its wheel's platform tag is manylinux_2_24 only: no --platform list
            "$py" -m pip download -q "${tags[@]}" -d .whl-fa3 fa3_fwd==0.0.3 ;;
        tokenizer)
            "$py" -m benchmarks.serving.bench_serving_gpu --write-tokenizer .whl/SmolLM2-135M-Instruct.tokenizer.gguf ;;
        *)
            echo "fetch_gpu_wheels: unknown part '$part' (base, structured, fa3, tokenizer)" >&2
            exit 2 ;;
    esac
done
du -sh .whl .whl/structured .whl-fa3 2>/dev/null || true
