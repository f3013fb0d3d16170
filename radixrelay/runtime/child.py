"""What the scheduler and worker processes share: start-up from the command line, parent watching,
socket set-up. A child is started as ``python -m radixrelay.runtime.<kind>_process '<ChildArgs JSON>'``.

Children ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; the parent decides
what happens) and exit on their own within ``POLL_MS`` once their parent is gone, so a killed
server never leaves orphans holding the model or the KV cache.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from radixrelay.env import profile_dir, trace_steps
from radixrelay.runtime.messages import ChildArgs

POLL_MS = 500                         # longest a child blocks before checking on its parent


def run_child(name: str, body: Callable[[ChildArgs, zmq.Context], int]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = msgspec.json.decode(sys.argv[1], type=ChildArgs)
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s")
    ctx = zmq.Context()
    try:
        profiled = profile_dir() and trace_steps() is None
        code = _profiled(name, body, args, ctx) if profiled else body(args, ctx)
    finally:
        ctx.destroy(linger=0)
    sys.exit(code)


def _profiled(name: str, body: Callable[[ChildArgs, zmq.Context], int], args: ChildArgs,
              ctx: zmq.Context) -> int:
    """``body`` under cProfile; the profile and a text summary go to ``RADIXRELAY_PROFILE_DIR``."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    code = profiler.runcall(body, args, ctx)
    out = profile_dir()
    os.makedirs(out, exist_ok=True)
    profiler.dump_stats(os.path.join(out, f"{name}.prof"))
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    with open(os.path.join(out, f"{name}.txt"), "w") as f:
        f.write(text.getvalue())
    return code


class FrameDecoder:
    """Decodes one channel's frames; a frame that is not a message of the channel (garbage bytes,
    a truncated message, a message of another channel) is logged, counted and dropped (None), so
    that one bad frame never takes a process down. ``drop`` counts frames that decoded but are not
    expected at this point of the protocol (the caller decides)."""

    def __init__(self, kind: Any, channel: str, logger: logging.Logger) -> None:
        self._decode = msgspec.msgpack.Decoder(kind).decode
        self.channel = channel
        self.logger = logger
        self.dropped = 0

    def __call__(self, raw: bytes) -> Any | None:
        try:
            return self._decode(raw)
        except msgspec.DecodeError as exc:        # ValidationError is a DecodeError
            self.drop(f"{len(raw)} bytes that do not decode: {exc}")
            return None

    def drop(self, why: str) -> None:
        self.dropped += 1
        self.logger.error("dropped a malformed frame on %s (%d so far): %s", self.channel,
                          self.dropped, why)


def parent_gone(args: ChildArgs) -> bool:
    return os.getppid() != args.parent_pid


def bind_pull(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    return sock


def connect_push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    return sock
