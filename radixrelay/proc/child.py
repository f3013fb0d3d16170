"""What the scheduler and worker processes share: start-up from the command line, parent watching,
socket set-up and a bounded exit. A child is started as
``python -m radixrelay.<kind>.<kind>_process '<ChildArgs JSON>'``.

Children ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; the parent decides
what happens). Invariants, for every process the launcher starts (``run_child``):

- A child always exits. Its sockets linger at most ``LINGER_MS`` on messages nobody receives, the
  context is terminated on a thread given ``LINGER_MS`` plus ``CLOSE_SLACK_S``, and the process then
  ends with ``os._exit`` whatever is left (no interpreter teardown that could block).
- A child exits within moments of its parent's death, whatever its main thread is doing (a model
  load, a step, a blocked call): a watcher thread waits on the parent (a pidfd, else polling
  ``getppid`` every ``POLL_MS``) and ends the process. A thread rather than ``PR_SET_PDEATHSIG``:
  that signal follows the thread that spawned the child (an ``Engine`` made on a short-lived thread
  would lose its runtime), and a fatal one would leave the socket directory behind.
- A child that stops running (stopped by a signal, frozen) is noticed by its parent within ``HUNG_S``:
  a heartbeat thread stamps ``beat-<pid>`` in the socket directory every ``BEAT_S`` with the system's
  monotonic clock, and the launcher reads the stamps (``RuntimeProcesses.dead_child``).
- The socket directory is removed by whichever runtime process exits last. The launcher puts one
  marker per child in it (``child-<pid>``); an exiting child removes its own, and a child whose
  parent is gone removes the directory once no marker names a live process. With the parent
  alive, the launcher's ``stop`` removes it.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from radixrelay.env import profile_dir, trace_steps
from radixrelay.protocol.messages import ChildArgs

POLL_MS = 500                         # longest a child blocks before checking on its parent
LINGER_MS = 1000                      # longest a closing socket keeps unsent messages
CLOSE_SLACK_S = 1.0                   # context termination's allowance beyond LINGER_MS
MARKER_PREFIX = "child-"              # + pid: a runtime process that may still use the socket directory
BEAT_PREFIX = "beat-"                 # + pid: the time.monotonic() of the child's last heartbeat (float64)
BEAT_S = 0.1                          # seconds between heartbeats

_exiting = threading.Lock()           # held by the one thread that ends the process
_HAVE_PROC = os.path.exists("/proc/self/stat")


def run_child(name: str, body: Callable[[ChildArgs, zmq.Context], int]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = msgspec.json.decode(sys.argv[1], type=ChildArgs)
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s")
    threading.Thread(target=_watch_parent, args=(args,), name="parent-watch", daemon=True).start()
    threading.Thread(target=_heartbeat, args=(args,), name="heartbeat", daemon=True).start()
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, LINGER_MS)          # the default of every socket made from ctx
    code = 1
    try:
        profiled = profile_dir() and trace_steps() is None
        code = _profiled(name, body, args, ctx) if profiled else body(args, ctx)
    except Exception:  # noqa: BLE001 - one traceback per crash, then the bounded exit below
        logging.getLogger(f"radixrelay.{name}").exception("%s process failed", name)
    finally:
        _terminate(ctx)
        exit_process(args, code)


def _terminate(ctx: zmq.Context) -> None:
    """Close every socket and terminate the context, waiting at most LINGER_MS + CLOSE_SLACK_S."""
    closer = threading.Thread(target=ctx.destroy, kwargs={"linger": LINGER_MS}, name="zmq-term",
                              daemon=True)
    closer.start()
    closer.join(LINGER_MS / 1000 + CLOSE_SLACK_S)


def exit_process(args: ChildArgs, code: int, why: str | None = None) -> None:
    """End the process now (never returns): leave the socket directory (the last process out
    removes it), then ``os._exit``. Safe from any thread; the first caller wins."""
    _exiting.acquire()
    if why is not None:         # a raw write: logging's locks may be held by the main thread
        os.write(2, f"{os.getpid()}: {why}; exiting\n".encode(errors="replace"))
    else:
        logging.shutdown()
    leave_socket_dir(Path(args.ipc_dir), parent_gone(args))
    os._exit(code)


def _watch_parent(args: ChildArgs) -> None:
    try:
        fd = os.pidfd_open(args.parent_pid)
    except ProcessLookupError:
        fd = None                               # already gone
    except (AttributeError, OSError):           # no pidfd (not Linux, or an old kernel): poll
        while not parent_gone(args):
            time.sleep(POLL_MS / 1000)
        fd = None
    if fd is not None and not parent_gone(args):  # the pid was the parent's when the fd was made
        select.select([fd], [], [])             # readable once the parent has exited
    exit_process(args, 1, f"parent process {args.parent_pid} is gone")


def marker(ipc_dir: Path, pid: int) -> Path:
    return ipc_dir / f"{MARKER_PREFIX}{pid}"


def beat_file(ipc_dir: Path, pid: int) -> Path:
    return ipc_dir / f"{BEAT_PREFIX}{pid}"


def last_beat(ipc_dir: Path, pid: int) -> float | None:
    """The monotonic time of the child's last heartbeat; None before its first one (or without one)."""
    try:
        with open(beat_file(ipc_dir, pid), "rb") as f:
            raw = f.read(8)
    except OSError:
        return None
    return struct.unpack("<d", raw)[0] if len(raw) == 8 else None


def _heartbeat(args: ChildArgs) -> None:
    try:
        fd = os.open(beat_file(Path(args.ipc_dir), os.getpid()), os.O_WRONLY | os.O_CREAT, 0o600)
        while True:
            os.pwrite(fd, struct.pack("<d", time.monotonic()), 0)
            time.sleep(BEAT_S)
    except OSError:
        return                          # the socket directory is gone: the runtime is stopping


def leave_socket_dir(ipc_dir: Path, parent_gone: bool) -> None:
    """Remove this process's marker; with the parent gone, remove the directory once no marker in
    it names a live process (each process removes its marker before looking, so the last one out
    finds none)."""
    marker(ipc_dir, os.getpid()).unlink(missing_ok=True)
    if not parent_gone:
        return
    try:
        names = os.listdir(ipc_dir)
    except FileNotFoundError:
        return
    pids = [int(n[len(MARKER_PREFIX):]) for n in names
            if n.startswith(MARKER_PREFIX) and n[len(MARKER_PREFIX):].isdigit()]
    if not any(alive(pid) for pid in pids):
        shutil.rmtree(ipc_dir, ignore_errors=True)


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it holds no sockets and may never be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not _HAVE_PROC            # with /proc: it exited since the kill(0)
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


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
