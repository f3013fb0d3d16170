#!/usr/bin/env bash
# Sets up .venv with the test dependencies and runs the whole CPU test suite.
# Triton kernels run under TRITON_INTERPRET=1 on machines without a GPU (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
