"""Server lifecycle with real processes: queue limit (429), SIGTERM drain, worker death.

Each scenario that ends its server gets its own small one (1024 KV tokens), of the tiny dummy model
(``tests/runtime/server_process.py``: the model's words do not matter here, and a start-up costs less).
Its steps take milliseconds, so the requests that must still run when something happens to them ask
for hundreds of tokens.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.runtime.server_process import ServerProcess, pid_alive

pytestmark = pytest.mark.timeout(300)
BODY = {"model": "default", "prompt": "Tell me a story.", "temperature": 0, "ignore_eos": True}


class StreamReader(threading.Thread):
    """Reads one streaming completion in the background; ``started`` is set at the first event."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base_url, self.max_tokens = base_url, max_tokens
        self.started = threading.Event()
        self.status: int | None = None
        self.events: list[str] = []
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.base_url}/v1/completions", timeout=120,
                              json={**BODY, "max_tokens": self.max_tokens, "stream": True}) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    self.events.append(r.read().decode())
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc
        finally:
            self.started.set()


def leftovers(srv: ServerProcess) -> list[str]:
    """Runtime processes still alive and socket directories still present."""
    procs = [f"pid {p}" for p in srv.child_pids if pid_alive(p)]
    return procs + [p for p in os.listdir(srv.runtime_tmp) if p.startswith("radixrelay-")]


def wait_exit(srv: ServerProcess, timeout: float) -> int:
    srv.proc.wait(timeout)
    deadline = time.monotonic() + 5
    while leftovers(srv) and time.monotonic() < deadline:
        time.sleep(0.1)
    return srv.proc.returncode


@pytest.fixture(scope="module")
def drain_server(tmp_path_factory, tiny_model):
    """Serves the queue-limit test, then the SIGTERM test ends it (tests run in file order)."""
    srv = ServerProcess(tmp_path_factory.mktemp("drain"), *tiny_model, "--kv-cache-tokens", "1024",
                        "--max-running-requests", "1", "--max-queued-requests", "1",
                        "--drain-timeout", "60")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_full_queue_gets_429(drain_server):
    readers = [StreamReader(drain_server.base_url, 200) for _ in range(4)]
    for r in readers:
        r.start()
    for r in readers:
        r.join(120)
    statuses = sorted(r.status for r in readers)
    # One request runs, at most one waits: of four sent at once, at least two are refused.
    assert statuses.count(429) >= 2 and statuses.count(200) >= 1, statuses
    for r in readers:
        if r.status == 429:
            assert json.loads(r.events[-1])["error"]["code"] == "queue_full"
        else:
            assert r.events[-1] == "[DONE]" and json.loads(r.events[-2])["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{drain_server.base_url}/health").status_code == 200


def test_sigterm_drains_in_flight_then_exits_cleanly(drain_server):
    srv = drain_server
    reader = StreamReader(srv.base_url, 600)
    reader.start()
    assert reader.started.wait(60) and reader.status == 200
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert httpx.get(f"{srv.base_url}/health").status_code == 503
    refused = httpx.post(f"{srv.base_url}/v1/completions", json={**BODY, "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
    reader.join(120)
    assert reader.error is None
    assert reader.events[-1] == "[DONE]"
    last = json.loads(reader.events[-2])
    assert last["choices"][0]["finish_reason"] == "length"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in reader.events[:-1])
    assert text
    assert wait_exit(srv, 60) == 0
    assert leftovers(srv) == []


@pytest.fixture
def doomed_server(tmp_path, tiny_model):
    srv = ServerProcess(tmp_path, *tiny_model, "--kv-cache-tokens", "1024")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_worker_death_fails_requests_and_exits(doomed_server):
    srv = doomed_server
    stream = StreamReader(srv.base_url, 900)
    stream.start()
    result: dict[str, httpx.Response] = {}
    plain = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        f"{srv.base_url}/v1/completions", json={**BODY, "max_tokens": 900}, timeout=120)), daemon=True)
    plain.start()
    assert stream.started.wait(60) and stream.status == 200
    os.kill(srv.child("worker"), signal.SIGKILL)
    killed = time.monotonic()
    while httpx.get(f"{srv.base_url}/health").status_code != 503:
        assert time.monotonic() - killed < 2.0, "/health still 200 two seconds after the worker died"
        time.sleep(0.05)
    stream.join(30)
    plain.join(30)
    assert not stream.is_alive() and not plain.is_alive()        # nobody hangs
    assert stream.events[-1] == "[DONE]"
    error = json.loads(stream.events[-2])["error"]
    assert error["code"] == "runtime_unavailable" and "worker" in error["message"]
    assert result["r"].status_code == 503 and result["r"].json()["error"]["type"] == "server_error"
    assert wait_exit(srv, 30) == 1
    assert leftovers(srv) == []
