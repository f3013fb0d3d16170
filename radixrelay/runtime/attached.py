"""``AttachedRuntime``: a runtime that another process started, seen from an HTTP server that shares it
(``--api-servers``: servers 1..n-1 attach to the runtime server 0 started).

It is watched, never stopped from here: dead once server 0 is gone (it owns the runtime, and these
servers are its children) or once a runtime process stopped running (its marker gone or its heartbeat
older than ``HUNG_S``: ``radixrelay.proc.child``), or once one is gone (a zombie counts).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

from radixrelay.proc.child import alive, last_beat, marker
from radixrelay.protocol.messages import Endpoints
from radixrelay.runtime.launcher import HUNG_S


class AttachedRuntime(msgspec.Struct, frozen=True):
    endpoints: Endpoints
    ipc_dir: str                      # the runtime's socket directory (markers and heartbeats)
    owner_pid: int                    # server 0, the parent of this process
    children: dict[str, int]          # the runtime's processes: name -> pid

    def dead_child(self) -> str | None:
        """What is dead (None while all run): server 0, or a runtime process."""
        if os.getppid() != self.owner_pid:
            return f"server 0 (pid {self.owner_pid}) exited"
        now, ipc_dir = time.monotonic(), Path(self.ipc_dir)
        for name, pid in self.children.items():
            beat = last_beat(ipc_dir, pid)
            if not marker(ipc_dir, pid).exists() or beat is None or not alive(pid):
                return f"the {name} process (pid {pid}) exited"
            if now - beat > HUNG_S:
                return f"the {name} process (pid {pid}) has not run for {now - beat:.1f} s (stopped or hung)"
        return None

    def stop(self, timeout: float = 0.0) -> None:
        """Nothing to stop: server 0 stops the runtime."""
