#!/usr/bin/env bash
# Sets up .venv with the test dependencies and runs the whole CPU test suite (or the pytest
# arguments given: `bash scripts/test.sh tests/server -x`).
# Triton kernels run under TRITON_INTERPRET=1 on machines without a GPU (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev
# -q unless the caller chose a verbosity (a second -q would hide pytest's summary line)
quiet=(-q)
for arg in "$@"; do
    case "$arg" in -q|-qq|--quiet|-v|-vv|--verbose) quiet=() ;; esac
done
exec .venv/bin/python -m pytest "${quiet[@]}" -p no:cacheprovider "$@"
