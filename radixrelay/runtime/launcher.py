"""Start, watch and stop the runtime's child processes (one scheduler, one worker).

Children are started with ``subprocess`` as ``python -m radixrelay.<kind>.<kind>_process`` and get
their arguments as msgspec JSON on the command line. (Not ``multiprocessing``: its spawn start
pickles the process object and re-imports the parent's ``__main__``, which would break scripts
that use ``Engine`` without an ``if __name__ == "__main__"`` guard.)

Sockets are ``ipc://`` files in a private directory (mode 0700, from ``mkdtemp``; ``socket_dir``) that
``stop`` removes. Invariant: after ``stop`` returns, no child process and no socket file is left. Every child
also gets a marker file in that directory, so that when this process dies without ``stop`` the
children exit on their own and the last one out removes the directory (``radixrelay.proc.child``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from radixrelay.config import EngineConfig
from radixrelay.protocol.messages import ChildArgs, Endpoints
from radixrelay.proc.child import last_beat, marker
from radixrelay.runtime.preflight import check_startup

logger = logging.getLogger("radixrelay.runtime")
CHILD_KINDS = ("worker", "scheduler")          # the worker is tensor-parallel rank 0; ranks 1.. are workers too
# Every process of a tensor-parallel runtime: no NVLink multicast (NVLS), which can take a shared
# host's GPUs out of service.
TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# A ready runtime's child whose heartbeat (``radixrelay.proc.child``) is older than this has stopped running.
HUNG_S = 1.2
# An ipc:// socket's path must fit ``sockaddr_un.sun_path``: 107 bytes and a NUL on Linux.
IPC_PATH_MAX = 107
_DIR_PREFIX = "radixrelay-"
_DIR_NAME_LEN = len(_DIR_PREFIX) + 8                        # mkdtemp adds 8 random characters
_LONGEST_SOCKET = max(map(len, Endpoints.__struct_fields__))   # the sockets are named after the channels


def socket_dir() -> Path:
    """A private directory for the sockets (mode 0700, from ``mkdtemp``): in the temporary directory
    (``TMPDIR``) where the socket paths fit there, else in /tmp (a long ``TMPDIR`` would fail every
    bind with an obscure ZMQ error)."""
    bases = [tempfile.gettempdir(), "/tmp"]
    for base in bases:
        if len(os.fsencode(base)) + 1 + _DIR_NAME_LEN + 1 + _LONGEST_SOCKET <= IPC_PATH_MAX:
            if base != bases[0]:
                logger.info("socket directory in %s: the temporary directory's path (%s) is too long for "
                            "socket paths", base, bases[0])
            return Path(tempfile.mkdtemp(prefix=_DIR_PREFIX, dir=base))
    raise RuntimeError(f"no directory for the runtime's sockets: socket paths under {bases[0]!r} exceed "
                       f"{IPC_PATH_MAX} bytes; set TMPDIR to a shorter path")


class RuntimeProcesses:
    def __init__(self, config: EngineConfig, frontends: int = 1) -> None:
        """``frontends``: the HTTP server processes that will talk to the runtime (``--api-servers``); each
        gets its own inbox (``Endpoints.frontend_inboxes``)."""
        if frontends < 1:
            raise ValueError(f"frontends must be >= 1, got {frontends}")
        self.config = config
        self.ipc_dir = socket_dir()
        def ipc(name: str) -> str:
            return f"ipc://{self.ipc_dir / name}"
        self.endpoints = Endpoints(ipc("frontend_to_scheduler"), ipc("scheduler_to_frontend"),
                                   ipc("scheduler_to_worker"), ipc("worker_to_scheduler"),
                                   ranks=[ipc(f"rank{r}") for r in range(1, config.tp)],
                                   rendezvous=str(self.ipc_dir / "rendezvous") if config.tp > 1 else "",
                                   rank_reports=ipc("rank_reports") if config.tp > 1 else "",
                                   frontends=[ipc(f"frontend{i}") for i in range(1, frontends)])
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        # Set by the client once the runtime is ready: from then on a child that stops running counts
        # as dead (start-up may block a process's threads in long native calls).
        self.watch_hangs = False

    def spawn(self) -> None:
        """Start the children; the frontend must have bound ``scheduler_to_frontend`` (or will). A bad
        environment variable or tensor-parallel size raises ``ValueError`` here, before any child starts."""
        check_startup(self.config)
        level = logging.getLevelName(logger.getEffectiveLevel())
        children = [(kind, kind, 0) for kind in CHILD_KINDS]
        children += [(f"worker rank {r}", "worker", r) for r in range(1, self.config.tp)]
        env = {**os.environ, **TP_ENV} if self.config.tp > 1 else None
        for name, kind, rank in children:
            args = msgspec.json.encode(ChildArgs(self.config, self.endpoints, os.getpid(), str(self.ipc_dir),
                                                 level, rank)).decode()
            proc = subprocess.Popen([sys.executable, "-m", f"radixrelay.{kind}.{kind}_process", args],
                                    stdin=subprocess.DEVNULL, env=env)
            self.children[name] = proc
            marker(self.ipc_dir, proc.pid).touch()

    def dead_child(self) -> str | None:
        """A description of the first child that has exited, None while all run."""
        for kind, proc in self.children.items():
            code = proc.poll()
            if code is not None:
                return f"the {kind} process (pid {proc.pid}) exited with code {code}"
        if self.watch_hangs:
            now = time.monotonic()
            for kind, proc in self.children.items():
                beat = last_beat(self.ipc_dir, proc.pid)
                if beat is not None and now - beat > HUNG_S:
                    return f"the {kind} process (pid {proc.pid}) has not run for {now - beat:.1f} s (stopped or hung)"
        return None

    def stop(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` for the children to exit (after a ShutdownRequest), then
        terminate, then kill them; remove the socket directory. Idempotent."""
        deadline = time.monotonic() + timeout
        for proc in self.children.values():
            _wait(proc, max(0.0, deadline - time.monotonic()))
        for proc in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)       # a stopped child acts on the signals that follow
                proc.terminate()
                if not _wait(proc, 2.0):
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True
