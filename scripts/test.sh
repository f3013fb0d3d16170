#!/usr/bin/env bash
# Sets up .venv with the test dependencies and runs the whole CPU test suite (or the pytest
# arguments given: `bash scripts/test.sh tests/server -x`).
# Triton kernels run under TRITON_INTERPRET=1 on machines without a GPU (tests/conftest.py).
# Tests run on RADIXRELAY_TEST_WORKERS pytest-xdist workers (default 2; 0 runs them in this process),
# whole files per worker (a module's server starts once), every process with one torch thread unless
# OMP_NUM_THREADS says otherwise: two workers' engines on two cores would otherwise oversubscribe the
# CPU, and OpenMP's spinning barriers then make steps many times slower.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev
# -q unless the caller chose a verbosity (a second -q would hide pytest's summary line)
quiet=(-q)
for arg in "$@"; do
    case "$arg" in -q|-qq|--quiet|-v|-vv|--verbose) quiet=() ;; esac
done
workers="${RADIXRELAY_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)   # keep the order: slow files first
fi
exec .venv/bin/python -m pytest "${quiet[@]}" -p no:cacheprovider "${parallel[@]}" "$@"
