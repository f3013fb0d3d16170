"""Test helper: run ``radixrelay serve`` as a real process on a free port, with its own TMPDIR
(``runtime_tmp``, so the test can check that the private socket directory is gone afterwards)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT = 180.0
# A tiny Llama (2 layers, width 64) with the default model's vocabulary and context, for tests of the
# server's processes, faults, limits and HTTP behaviour, whose assertions do not depend on what the model
# says: random weights (``--load-format dummy``, seeded: every server gets the same), the default model's
# tokenizer and chat template. A start-up loads no checkpoint and fills no large KV pool, and a decode
# step costs milliseconds, not the default model's ~75 ms on one CPU thread (~5 CPU-s less per start).
TINY_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": False}


# The rest of an Engine's (or EngineConfig's) arguments for the tiny model: ``model=str(directory)``.
TINY_ENGINE = {"load_format": "dummy", "tokenizer": "default"}


def write_tiny_model(directory: Path) -> Path:
    """``directory`` holding the tiny model's ``config.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG))
    return directory


def tiny_model_args(directory: Path) -> tuple[str, ...]:
    """``radixrelay serve`` arguments serving the tiny model in ``directory`` (``write_tiny_model``) as
    ``default``, so that requests name the model as they do on a default server."""
    return ("--model", str(directory), "--load-format", "dummy", "--tokenizer", "default",
            "--served-model-name", "default")


def short_temp_dir() -> Path:
    """A private directory with a short path under /tmp. The runtime's socket paths must fit 107 bytes;
    under pytest-xdist a test's ``tmp_path`` can be too deep for them (the runtime then falls back to
    /tmp, and a test looking for the socket directory in its TMPDIR would check nothing)."""
    return Path(tempfile.mkdtemp(prefix="rr-", dir="/tmp"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


class ServerProcess:
    def __init__(self, tmp_dir: Path, *args: str) -> None:
        self.tmp_dir = tmp_dir                     # the server's log
        self.runtime_tmp = short_temp_dir()        # the server's TMPDIR: its socket directory goes here
        self.args = args
        self.log = open(tmp_dir / "server.log", "wb")
        self.child_pids: list[int] = []
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "TMPDIR": str(self.runtime_tmp)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixrelay.cli", "serve", "--port", str(self.port),
             "--log-level", "warning", *self.args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> ServerProcess:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        retries = 3          # the free port may be taken by a parallel test process before the server binds it
        # one client for every poll: httpx.get builds a client (and an SSL context) per call, which costs
        # the test process more CPU than the polling itself
        with httpx.Client(timeout=2) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    log = self.read_log()
                    if retries and "address already in use" in log.lower():
                        retries -= 1
                        self._start()
                        continue
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log}")
                try:
                    if http.get(f"{self.base_url}/health").status_code == 200:
                        self.child_pids = children_of(self.proc.pid)
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT} s:\n{self.read_log()}")

    def child(self, kind: str) -> int:
        [pid] = [p for p in self.child_pids if f"radixrelay.{kind}.{kind}_process" in cmdline(p)]
        return pid

    def read_log(self) -> str:
        self.log.flush()
        return (self.tmp_dir / "server.log").read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        """Make sure nothing of this server is left running (used by fixtures' teardown)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.send_signal(signal.SIGINT)      # the second signal skips the drain
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.child_pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()
        shutil.rmtree(self.runtime_tmp, ignore_errors=True)
