"""``serve --api-servers 2``: two HTTP server processes on one port, one runtime (radixrelay.server.api_servers).

Every request here goes over a connection of its own, so the kernel spreads them over both servers
(``SO_REUSEPORT``); ``radixrelay_api_server_requests_total{server=...}`` says which server took each.
The servers run the tiny dummy model (``tests/runtime/server_process.py``): what is tested here does not
depend on the model's words, and its steps take milliseconds, so streams that must be in flight when
something happens ask for hundreds of tokens and the tests wait for their first chunks, not for a time.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from radixrelay.server.api_servers import ServerGroup, listening_socket
from tests.runtime.server_process import ServerProcess, cmdline, pid_alive

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
BODY = {"model": "default", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
PLAIN = """<schema name="plain">
  <module name="preamble">You are a helpful assistant. Answer every question in one short, clear sentence.</module>
</schema>"""
KEY = "k-7f3a9c2e"
FRESH = 12          # requests over connections of their own: all on one server with odds 2**-11


def fresh(method: str, url: str, **kwargs) -> httpx.Response:
    """One request on a connection of its own (a new client; the connection closes after it)."""
    with httpx.Client(timeout=60, headers={"connection": "close"}) as http:
        return http.request(method, url, **kwargs)


def samples(text: str, name: str) -> dict[str, float]:
    """``radixrelay_<name>`` samples of an exposition: labels text -> value."""
    return {m[1] or "": float(m[2]) for m in re.finditer(rf"^radixrelay_{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)}


def api_server_pids(srv: ServerProcess) -> list[int]:
    return [p for p in srv.child_pids if "radixrelay.server.api_server_process" in cmdline(p)]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    srv = ServerProcess(tmp_path_factory.mktemp("api-servers"), *tiny_model, "--api-servers", "2")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_requests_spread_over_the_servers_and_answer_alike(server):
    assert len(api_server_pids(server)) == 1           # server 0 started server 1 as its child
    before = samples(fresh("GET", f"{server.base_url}/metrics").text, "api_server_requests_total")
    texts = [fresh("POST", f"{server.base_url}/v1/completions", json=BODY).json()["choices"][0]["text"]
             for _ in range(FRESH)]
    assert len(set(texts)) == 1 and texts[0]            # greedy: the same answer whichever server took it
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**BODY, stream=True) if c.choices)
    assert streamed == texts[0]
    # each server took some; whichever server answers /metrics counts both
    for _ in range(4):
        text = fresh("GET", f"{server.base_url}/metrics").text
        after = samples(text, "api_server_requests_total")
        taken = {k: after[k] - before.get(k, 0.0) for k in after}
        assert set(taken) == {'{server="0"}', '{server="1"}'}, taken
        assert all(v > 0 for v in taken.values()) and sum(taken.values()) == FRESH + 1, taken
        stages = samples(text, "request_stage_seconds_count")
        assert stages['{stage="parse"}'] == stages['{stage="queue"}'] >= FRESH + 1


def test_a_schema_change_reaches_every_server(server):
    base = f"{server.base_url}/v1/schemas"
    made = fresh("POST", base, json={"schema": PLAIN})
    assert made.status_code == 200, made.text
    assert {fresh("GET", f"{base}/plain").json()["digest"] for _ in range(6)} == {made.json()["digest"]}
    again = fresh("POST", base, json={"schema": PLAIN.replace("helpful", "careful")})   # replaces it everywhere
    assert again.status_code == 200 and again.json()["digest"] != made.json()["digest"], again.text
    assert {fresh("GET", f"{base}/plain").json()["digest"] for _ in range(6)} == {again.json()["digest"]}
    bad = fresh("POST", base, json={"schema": "<schema name='x'>"})
    assert bad.status_code == 400 and "error" in bad.json()
    assert fresh("DELETE", f"{base}/plain").json()["deleted"] is True
    assert {fresh("GET", f"{base}/plain").status_code for _ in range(8)} == {404}
    gone = fresh("DELETE", f"{base}/plain")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "schema_not_found"


def test_clients_that_leave_abort_their_requests_on_both_servers(server):
    """Clients that give up: their requests end on the runtime and leave no KV held."""
    long = {**BODY, "max_tokens": 4000, "ignore_eos": True}
    for _ in range(4):
        with pytest.raises(httpx.TimeoutException):
            with httpx.Client(timeout=0.5, headers={"connection": "close"}) as http:
                http.post(f"{server.base_url}/v1/completions", json=long)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = fresh("GET", f"{server.base_url}/metrics").text
        running, idle = samples(text, "num_requests_running"), samples(text, "kv_idle_baseline")
        if running[""] == 0 and idle[""] == 1:
            break
        time.sleep(0.1)
    assert running[""] == 0
    assert idle[""] == 1                 # their KV pages and radix locks given back, whichever server took them


def test_sigterm_drains_every_server_then_all_exit(server):
    """Streams in flight on both servers finish (each whole: every token it asked for); then every
    process exits and the socket directory goes."""
    long = {**BODY, "max_tokens": 300}
    results: list[tuple[str, int]] = []
    started = threading.Barrier(7)           # the six streams, each with its first chunk, and the test

    def stream() -> None:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)
        chunks = iter(client.completions.create(**long, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        parts = [next(chunks).choices[0].text]
        started.wait(60)
        rest = list(chunks)
        parts += [c.choices[0].text for c in rest if c.choices]
        results.append(("".join(parts), rest[-1].usage.completion_tokens))

    threads = [threading.Thread(target=stream) for _ in range(6)]
    for t in threads:
        t.start()
    started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert len(results) == 6 and all(text and used == long["max_tokens"] for text, used in results), results
    assert server.proc.wait(60) == 0
    assert not any(pid_alive(p) for p in server.child_pids)
    assert not [p for p in server.runtime_tmp.iterdir() if p.name.startswith("radixrelay-")]


def test_server_0_sees_a_dead_api_server_and_drains_the_others():
    """``ServerGroup``'s watch of servers 1..N-1 (processes standing in for them): one that dies is named
    with its exit code (server 0 then exits 1, as after a runtime death); the others get SIGTERM, and one
    that outlives its drain is killed."""
    group = ServerGroup(0, 3)
    group.peers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
                   subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                     "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                                     "time.sleep(60)"], stdout=subprocess.PIPE)]
    try:
        assert group.peers[1].stdout.readline() == b"ready\n"      # its SIGTERM handler is in place
        assert group.dead_peer() is None
        group.peers[0].kill()
        group.peers[0].wait()
        assert group.dead_peer() == f"API server 1 (pid {group.peers[0].pid}) exited with code -9"
        started = time.monotonic()
        asyncio.run(group.stop_peers(0.5, slack=0.5))   # the second ignores SIGTERM: killed after the slack
        assert group.stopping and group.peers[1].returncode == -9
        assert time.monotonic() - started < 0.5 + 0.5 + 5
    finally:
        group.kill_peers()


def test_a_runtime_death_ends_every_api_server(tmp_path, monkeypatch, tiny_model):
    """With an API key (from the environment): every server asks for it, and server 1 was not given it
    on its command line (every user can read those). Then the scheduler killed while streams run on both
    servers: each server fails its requests with an error (server 1 sees the runtime's process gone),
    every process exits."""
    monkeypatch.setenv("RADIXRELAY_API_KEY", KEY)
    srv = ServerProcess(tmp_path, *tiny_model, "--api-servers", "2").wait_ready()
    try:
        [other] = api_server_pids(srv)
        assert KEY not in cmdline(other) and KEY not in cmdline(srv.proc.pid)
        refused = [fresh("POST", f"{srv.base_url}/v1/completions", json=BODY).status_code for _ in range(8)]
        assert refused == [401] * 8
        outcomes: list[str] = []
        started = threading.Barrier(7)           # the six streams, each with its first chunk, and the test

        def stream() -> None:
            client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
            try:
                chunks = iter(client.completions.create(**{**BODY, "max_tokens": 4000}, stream=True,
                                                        extra_body={"ignore_eos": True}))
                next(chunks)
                started.wait(60)
                for _ in chunks:
                    pass
                outcomes.append("finished")
            except (openai.APIError, httpx.HTTPError) as exc:
                outcomes.append(type(exc).__name__)

        threads = [threading.Thread(target=stream) for _ in range(6)]
        for t in threads:
            t.start()
        started.wait(60)
        subprocess.run(["kill", "-KILL", str(srv.child("scheduler"))], check=True)
        for t in threads:
            t.join(60)
        assert len(outcomes) == 6 and "finished" not in outcomes, outcomes
        assert srv.proc.wait(30) == 1
        log = srv.read_log()
        assert re.search(r"api-server-1\[\d+\] ERROR runtime died: the scheduler process \(pid \d+\) exited", log), log
        deadline = time.monotonic() + 10
        while pid_alive(other) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in srv.child_pids)
    finally:
        srv.stop()


def test_the_number_of_api_servers_is_checked(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "radixrelay.cli", "serve", "--api-servers", "0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "api_servers" in proc.stderr


def test_connections_on_the_shared_port_have_nagle_off():
    """asyncio sets TCP_NODELAY only on sockets whose proto is TCP; without it a kept-alive connection's
    answers waited ~40 ms each for the client's delayed ACKs."""
    async def main() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = listening_socket("127.0.0.1", 0, reuse_port=True)
        server = await asyncio.start_server(accepted, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(main()) != 0
