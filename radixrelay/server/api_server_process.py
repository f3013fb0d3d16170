"""API server 1..N-1 of ``serve --api-servers N``: started by server 0 as
``python -m radixrelay.server.api_server_process`` with its ``ApiServerArgs`` as JSON on stdin (they hold
the API key: not on the command line, which every user can read) once its runtime is ready
(``radixrelay.server.api_servers``). It binds the same port, attaches to the runtime, and serves until
server 0 drains it (SIGTERM), or exits when server 0 or the runtime is gone.
"""

from __future__ import annotations

import logging
import sys

import msgspec

from radixrelay.server.api_servers import ApiServerArgs
from radixrelay.server.serve import run_server


def main() -> int:
    args = msgspec.json.decode(sys.stdin.buffer.read(), type=ApiServerArgs)
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s api-server-{args.index}[%(process)d] %(levelname)s %(message)s")
    return run_server(args.engine, args.server, attach=args)


if __name__ == "__main__":
    sys.exit(main())
