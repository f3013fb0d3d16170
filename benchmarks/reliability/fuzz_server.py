"""Hostile-input drive: schemathesis cases generated from the server's /openapi.json (alternating
batches of valid and invalid requests) plus the hand-written hostile corpus, against a server this
script starts on the default model (or ``--base-url``). Prints, and with ``--output`` writes, a
markdown table: requests tried, responses by status class, >= 500 count, hangs, and the
/health + normal-request checks passed after each batch. Exits 1 if any guarantee broke.

    python -m benchmarks.reliability.fuzz_server --cases 2000 --output benchmarks/results/reliability/fuzz_server_cpu.md
    python -m benchmarks.reliability.fuzz_server --base-url http://127.0.0.1:30000 --model default --cases 500

Needs the dev extra (schemathesis).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from tests.runtime.server_process import ServerProcess
from tests.server.hostile import Tally, drive


def table(tally: Tally) -> str:
    rows = [("requests tried", tally.tried), ("2xx", tally.by_class["2xx"]),
            ("4xx", tally.by_class["4xx"]), (">= 500", tally.server_errors), ("hangs", tally.hangs),
            ("/health + normal request checks passed",
             f"{tally.health_passed} / {tally.health_checks}"),
            ("other broken guarantees", len(tally.problems) - tally.server_errors - tally.hangs)]
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(tally.by_status.items()))
    lines = ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows),
             f"| by status | {statuses} |"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=2000, help="generated cases (plus the corpus)")
    parser.add_argument("--batch", type=int, default=100, help="cases between /health checks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before a request is a hang")
    parser.add_argument("--base-url", help="drive this server instead of starting one")
    parser.add_argument("--model", default="default", help="the served model name (with --base-url)")
    parser.add_argument("--output", type=Path, help="write the markdown report here")
    args = parser.parse_args()

    server = None
    if args.base_url is None:
        server = ServerProcess(Path(tempfile.mkdtemp(prefix="fuzz_server_")), "--kv-cache-tokens", "4096")
        server.wait_ready()
    base_url = args.base_url or server.base_url
    started = time.monotonic()
    try:
        tally = drive(base_url, model=args.model, cases=args.cases, batch=args.batch, seed=args.seed,
                      timeout=args.timeout, log=lambda line: print(line, flush=True))
    finally:
        if server is not None:
            server.stop()
    minutes = (time.monotonic() - started) / 60
    report = table(tally)
    print(report)
    for problem in tally.problems[:50]:
        print("PROBLEM", problem)
    if args.output is not None:
        command = "python -m benchmarks.reliability.fuzz_server " + shlex.join(sys.argv[1:])
        where = args.base_url or "a server started by the script (the default model, --kv-cache-tokens 4096)"
        args.output.write_text(
            f"# Hostile input: generated and hand-written requests\n\n"
            f"Command: `{command}`  \n"
            f"Machine: {os.cpu_count()}-core CPU ({platform.machine()}, {platform.system()}), "
            f"{where}, {minutes:.1f} min  \n"
            f"Date: {date.today().isoformat()}\n\n{report}\n")
    return 0 if not tally.problems and tally.health_passed == tally.health_checks else 1


if __name__ == "__main__":
    sys.exit(main())
