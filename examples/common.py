"""Shared by the examples: pick the backend from the command line.

    python examples/<name>.py                          # a server already on http://127.0.0.1:30000
    python examples/<name>.py --url http://host:port   # another radixrelay server
    python examples/<name>.py --launch                 # start one here (rl.Runtime), stop it at the end
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import radixrelay.lang as rl


def main(description: str, run: Callable[[argparse.Namespace], None],
         add_args: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="radixrelay server (default: %(default)s)")
    parser.add_argument("--launch", action="store_true", help="start a local server with the default model")
    if add_args is not None:
        add_args(parser)
    args = parser.parse_args()
    backend = rl.Runtime("default") if args.launch else rl.RuntimeEndpoint(args.url)
    rl.set_default_backend(backend)
    try:
        run(args)
    finally:
        backend.shutdown() if isinstance(backend, rl.Runtime) else backend.close()
