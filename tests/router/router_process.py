"""Test helper: ``radixrelay router`` as a real process on a free port, ready once its ``/health`` is 200
(at least one replica answers), its output in a log file under the test's directory."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from tests.runtime.server_process import free_port

STARTUP_TIMEOUT = 60.0


class RouterProcess:
    def __init__(self, tmp_path: Path, *replicas: str, mode: str = "approximate", store: str | None = None,
                 extra: tuple[str, ...] = (), log_level: str = "warning") -> None:
        """``extra``: more ``radixrelay router`` flags (limits, timeouts)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"router-{mode}-{self.port}.log"
        self.log = open(self.log_path, "wb")
        args = [a for url in replicas for a in ("--replica", url)] + (["--store", store] if store else [])
        self.proc = subprocess.Popen([sys.executable, "-m", "radixrelay.cli", "router", *args, "--mode", mode,
                                      "--port", str(self.port), "--log-level", log_level, *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("router not ready")

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=120)

    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=5).text

    def metric(self, prefix: str) -> float:
        """The value of the first metrics line starting with ``prefix`` (0 when there is none)."""
        for line in self.metrics().splitlines():
            if line.startswith(prefix):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
