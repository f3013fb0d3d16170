#!/usr/bin/env bash
# Sets up .venv and runs the main job: the OpenAI-compatible server (`radixrelay serve`) on the
# embedded default model, at http://127.0.0.1:30000. Arguments replace the default `serve`
# and go to the `radixrelay` CLI (`scripts/run.sh serve --port 8000`, `scripts/run.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/radixrelay "${@:-serve}"
