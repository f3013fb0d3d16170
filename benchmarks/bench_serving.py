"""Serving benchmark: radixrelay or any OpenAI-compatible server under generated workloads.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --workload shared-prefix \
        --num-requests 200 --request-rate 8 --output results.json

The implementation lives in ``radixrelay.bench``; ``--help`` lists every option and workload.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

from radixrelay.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
