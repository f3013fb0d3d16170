"""Serving benchmark: radixrelay or any OpenAI-compatible server under generated workloads.

    python -m benchmarks.serving.bench_serving --base-url http://127.0.0.1:30000 --workload shared-prefix \
        --num-requests 200 --request-rate 8 --output results.json

The implementation lives in ``radixrelay.bench``; ``--help`` lists every option and workload.
"""

import sys

from radixrelay.bench.command import main

if __name__ == "__main__":
    sys.exit(main())
