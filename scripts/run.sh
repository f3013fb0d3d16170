#!/usr/bin/env bash
# Sets up .venv and runs the main job on the embedded default model.
# Extra arguments go to the `radixrelay` CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/radixrelay "${@:-generate}"
