"""The runtime's socket directory: every ipc:// path fits a Unix socket address, even when the
temporary directory's own path is long (a deep TMPDIR, a test runner's nested folders)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import zmq

from radixrelay.config import EngineConfig
from radixrelay.runtime.launcher import IPC_PATH_MAX, RuntimeProcesses


def _bind_all(processes: RuntimeProcesses) -> None:
    ctx = zmq.Context()
    try:
        for address in processes.endpoints.sockets():
            sock = ctx.socket(zmq.PULL)
            sock.bind(address)
            sock.close(linger=0)
    finally:
        ctx.term()


@pytest.mark.parametrize("depth", [1, 12])
def test_socket_paths_fit_however_deep_the_temporary_directory(monkeypatch, depth) -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp"))            # short: /tmp/tmpXXXXXXXX
    deep = base.joinpath(*["d" * 9] * depth)            # 1: fits; 12: over 107 bytes with the socket names
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    processes = RuntimeProcesses(EngineConfig(tp=8))       # with the inboxes of ranks 1..7 and rank 0's reports
    try:
        paths = [a.removeprefix("ipc://") for a in processes.endpoints.sockets()]
        assert len(paths) == 4 + 7 + 1 and all(len(p.encode()) <= IPC_PATH_MAX for p in paths)
        # a short temporary directory keeps the sockets; a long one sends them to /tmp
        assert processes.ipc_dir.parent == (deep if depth == 1 else Path("/tmp"))
        assert processes.ipc_dir.stat().st_mode & 0o777 == 0o700
        _bind_all(processes)                  # a path over the limit fails here with a ZMQError
    finally:
        processes.stop()
        shutil.rmtree(base)
    assert not processes.ipc_dir.exists()
