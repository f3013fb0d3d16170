# Sourced by the GPU scripts: results folder, carried wheels, device report.
# A bare GPU image lacks some of radixrelay's dependencies (msgspec, pyzmq, gguf): wheels carried in
# .whl/ (`pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl NAME`) are installed first.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest="${OUT:-benchmarks/results}"
mkdir -p "$dest"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
