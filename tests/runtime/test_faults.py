"""Faults under load, against the real server (real processes, real ZMQ; the tiny dummy model of
``tests/runtime/server_process.py``: what is tested here does not depend on what the model says, and its
steps cost milliseconds, so the loads are long in tokens and cheap).

Which faults recover and which end the server:

- a corrupted frame (garbage bytes, a truncated msgspec message, another channel's message, a
  message of the right channel that the protocol does not expect at that point) on any process's
  inbox: RECOVERS. The receiver logs and drops the frame (``radixrelay_malformed_frames_total``
  counts it) and keeps serving; requests in flight finish normally, nothing restarts.
- kill -9 of the worker, or of the scheduler, with streams and non-streaming requests in flight:
  CLEAN EXIT. Every stream gets an error event (``runtime_unavailable``) then ``[DONE]``, every
  non-streaming request a 503 with OpenAI's error JSON; /health turns 503 within 2 s, the server
  exits with code 1, no runtime process survives and the socket directory is removed. The worker is
  killed with 176 requests queued behind the 4 running ones: no /health probe waits a second and the
  log holds one line per failed request, no traceback per request.
- SIGSTOP of the worker (it stops running) with streams in flight: CLEAN EXIT as for a kill, with
  /health 503 within 2 s (the child's heartbeat goes stale) and the stopped child killed.
- kill -9 of the server itself (or SIGTERM, then kill -9 mid-drain) with 8 chats streaming: the
  children exit on their own within 5 s and the last one out removes the socket directory.
- KV oversubscribed 3x (a small ``--kv-cache-tokens``, concurrent requests): no fault at all;
  retraction makes room, every request completes with the greedy tokens of a large pool.

A server start costs seconds of CPU: the tests that leave their server running share one per
configuration (``shared``, the default; ``small``, an 8-page KV pool), and the file's last two tests
end those with their faults (the killed scheduler, the stopped worker) instead of starting their own.
Every request that a fault must find in flight asks for far more tokens than the fault needs to strike
(at a few ms per step, a short one could end before it).

No scenario may hang: every wait has a timeout. The servers run with one torch thread
(OMP_NUM_THREADS=1): on two cores the client and the server would otherwise oversubscribe the CPU,
and OpenMP's spinning barriers then make steps many times slower.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from radixrelay.protocol.messages import (
    AbortRequest, GenerateRequest, RuntimeReady, StatsRequest, WorkerReady, WorkerStep, encoder,
)
from radixrelay.protocol.step import StepPlan
from radixrelay.sampling_params import SamplingParams
from tests.runtime.server_process import STARTUP_TIMEOUT, ServerProcess, pid_alive

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
STREAMS, PLAIN = 8, 2
BODY = {"model": "default", "temperature": 0, "ignore_eos": True}
# The tests' own probes (/health, /metrics, single requests) share one client: httpx.get makes a client,
# and with it an SSL context, per call (~40 ms of CPU), and the probes run in loops.
PROBE = httpx.Client(timeout=30)


def start_server(tmp: Path, model: tuple[str, ...], *args: str) -> ServerProcess:
    """A server of ``model`` (the ``tiny_model`` fixture's arguments) with ``args``, ready."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        srv = ServerProcess(tmp, *model, *args)
        try:
            _wait_healthy(srv)
            return srv.wait_ready()          # at once now (or, if the server died, its retry or error)
        except BaseException:
            srv.stop()
            raise


def _wait_healthy(srv: ServerProcess) -> None:
    """Until /health answers 200, the server exits or the start-up timeout passes: the polling of
    ``ServerProcess.wait_ready``, on the shared client."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while srv.proc.poll() is None and time.monotonic() < deadline:
        try:
            if PROBE.get(f"{srv.base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)


def metric(base_url: str, name: str) -> float:
    text = PROBE.get(f"{base_url}/metrics").text
    match = re.search(rf"^radixrelay_{name} (\S+)$", text, re.M)
    assert match, name
    return float(match[1])


def socket_dirs(srv: ServerProcess) -> list[Path]:
    return [p for p in srv.runtime_tmp.iterdir() if p.name.startswith("radixrelay-")]


class SharedServer:
    """One server for the tests that leave it running (``get``); the last test that uses it ends it
    (``take``: no longer shared then, so a later ``get`` starts another one and the tests stay
    independent of their order)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, name: str, model: tuple[str, ...],
                 *args: str) -> None:
        self._tmp, self._name, self._model, self._args = tmp_path_factory, name, model, args
        self._srv: ServerProcess | None = None

    def get(self) -> ServerProcess:
        if self._srv is None:
            self._srv = start_server(self._tmp.mktemp(self._name), self._model, *self._args)
        return self._srv

    def take(self) -> ServerProcess:
        srv, self._srv = self.get(), None
        return srv

    def close(self) -> None:
        if self._srv is not None:
            self._srv.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory, tiny_model):
    """A default server (32K KV tokens): corrupted frames, the large-pool reference of the
    oversubscription test, then the stopped worker."""
    servers = SharedServer(tmp_path_factory, "faults", tiny_model)
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture(scope="module")
def small(tmp_path_factory, tiny_model):
    """A server with an 8-page KV pool: the oversubscription test, then the killed scheduler."""
    servers = SharedServer(tmp_path_factory, "small-kv", tiny_model, "--kv-cache-tokens", str(OVERSUB_POOL_TOKENS))
    try:
        yield servers
    finally:
        servers.close()


# -- load ----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    stream: bool
    status: int | None = None
    events: list[str] = field(default_factory=list)     # stream: data payloads; plain: the body
    error: str | None = None                            # transport error, if any


async def _stream(http: httpx.AsyncClient, url: str, body: dict, out: Outcome, started: asyncio.Event) -> None:
    try:
        async with http.stream("POST", url, json={**body, "stream": True}) as r:
            out.status = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    out.events.append(line[6:])
                    started.set()
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"


async def _plain(http: httpx.AsyncClient, url: str, body: dict, out: Outcome) -> None:
    try:
        r = await http.post(url, json=body)
        out.status, out.events = r.status_code, [r.text]
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"


async def under_load(base_url: str, max_tokens: int, fault, streams: int = STREAMS,
                     plain: int = PLAIN) -> list[Outcome]:
    """Start ``streams`` streaming and ``plain`` non-streaming completions, wait until every stream
    has its first event, run ``fault()``, then wait (bounded) for every request to end."""
    limits = httpx.Limits(max_connections=streams + plain + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        url = f"{base_url}/v1/completions"
        outs, tasks, flags = [], [], []
        for i in range(streams + plain):
            body = {**BODY, "prompt": f"Story number {i}: once upon a time", "max_tokens": max_tokens}
            out = Outcome(stream=i < streams)
            outs.append(out)
            if out.stream:
                flags.append(asyncio.Event())
                tasks.append(asyncio.create_task(_stream(http, url, body, out, flags[-1])))
            else:
                tasks.append(asyncio.create_task(_plain(http, url, body, out)))
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 120)
        assert not any(t.done() for t in tasks), "a request ended before the fault"
        await asyncio.to_thread(fault)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)        # nobody hangs
    return outs


# -- killed children: clean exit -----------------------------------------------------------------


def _assert_clean_errors(outs: list[Outcome], kind: str) -> None:
    for out in outs:
        assert out.error is None, out.error
        if out.stream:
            assert out.status == 200 and out.events[-1] == "[DONE]", out.events[-3:]
            error = json.loads(out.events[-2])["error"]
            assert error["code"] == "runtime_unavailable" and kind in error["message"], error
            assert error["type"] == "server_error"
        else:
            assert out.status == 503, (out.status, out.events)
            error = json.loads(out.events[0])["error"]
            assert error["type"] == "server_error" and error["code"] == "runtime_unavailable", error


def _kill_and_watch_health(srv: ServerProcess, kind: str) -> None:
    os.kill(srv.child(kind), signal.SIGKILL)
    killed = time.monotonic()
    while PROBE.get(f"{srv.base_url}/health", timeout=5).status_code != 503:
        assert time.monotonic() - killed < 2.0, "/health still 200 two seconds after the kill"
        time.sleep(0.05)


def _assert_clean_exit(srv: ServerProcess) -> None:
    assert srv.proc.wait(30) == 1
    deadline = time.monotonic() + 5
    while (any(pid_alive(p) for p in srv.child_pids) or socket_dirs(srv)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in srv.child_pids if pid_alive(p)], "orphaned runtime processes"
    assert socket_dirs(srv) == [], "socket directory left behind"


# -- killed server: no orphans --------------------------------------------------------------------


async def _chat_streams(base_url: str, n: int, fault) -> None:
    """``n`` streaming chats; once every one has its first event, ``fault()`` runs (in a thread)
    while they stream; then every stream ends within a bound (a dead server ends them at once)."""
    body = {"model": "default", "temperature": 0, "ignore_eos": True, "max_tokens": 4000, "stream": True}
    started = [asyncio.Event() for _ in range(n)]

    async def chat(i: int) -> None:
        messages = [{"role": "user", "content": f"Tell me story number {i}."}]
        try:
            async with http.stream("POST", f"{base_url}/v1/chat/completions",
                                   json={**body, "messages": messages}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        started[i].set()
        except httpx.HTTPError:
            pass                           # the server was killed under this stream
        finally:
            started[i].set()

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n + 4)) as http:
        tasks = [asyncio.create_task(chat(i)) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        assert not any(t.done() for t in tasks), "a stream ended before the fault"
        await asyncio.to_thread(fault)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)


@pytest.mark.parametrize("term_first", [False, True], ids=["kill", "term-then-kill"])
def test_killed_server_leaves_no_runtime_process_and_no_socket_directory(tmp_path, tiny_model, term_first):
    """kill -9 of the server process (or SIGTERM, then kill -9 half a second into the drain) while 8
    chats stream: within 5 s neither runtime child is alive (checked by pid) and the socket
    directory is gone. Children notice their parent's death on their own and always exit."""
    srv = start_server(tmp_path, tiny_model)
    gone_after: list[float] = []

    def kill_server() -> None:
        if term_first:
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        srv.proc.kill()
        assert srv.proc.wait(10) == -signal.SIGKILL        # killed, not exited on its own (drain over)
        killed = time.monotonic()
        while time.monotonic() - killed < 5.0:
            if not any(pid_alive(p) for p in srv.child_pids) and not socket_dirs(srv):
                gone_after.append(time.monotonic() - killed)
                return
            time.sleep(0.05)

    try:
        assert len(srv.child_pids) == 2 and len(socket_dirs(srv)) == 1
        asyncio.run(_chat_streams(srv.base_url, 8, kill_server))
        assert not [p for p in srv.child_pids if pid_alive(p)], "runtime processes outlived the server by 5 s"
        assert socket_dirs(srv) == [], "socket directory left behind"
        assert gone_after and gone_after[0] < 5.0
    finally:
        srv.stop()


# -- worker death with a long queue: /health first, one log line per request --------------------


RUNNING_STREAMS, RUNNING_PLAIN, QUEUED = 3, 1, 176
RUNNING = RUNNING_STREAMS + RUNNING_PLAIN


async def _queue_then(srv: ServerProcess, fault) -> list[Outcome]:
    """``RUNNING_STREAMS`` streams and ``RUNNING_PLAIN`` non-streaming requests run (the server admits
    no more), ``QUEUED`` non-streaming requests wait behind them; then ``fault()`` runs (in a thread)
    and every request ends within a bound."""

    async def wait_for_metric(name: str, value: int) -> None:
        deadline = time.monotonic() + 120
        while (await asyncio.to_thread(metric, srv.base_url, name)) < value:
            assert time.monotonic() < deadline, f"{name} never reached {value}"
            await asyncio.sleep(0.2)

    limits = httpx.Limits(max_connections=RUNNING + QUEUED + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        url = f"{srv.base_url}/v1/completions"
        outs = [Outcome(stream=i < RUNNING_STREAMS) for i in range(RUNNING + QUEUED)]
        flags = [asyncio.Event() for _ in range(RUNNING_STREAMS)]
        tasks = []
        for i, out in enumerate(outs):
            body = {**BODY, "prompt": f"Story number {i}: once upon a time", "max_tokens": 4000}
            if out.stream:
                tasks.append(asyncio.create_task(_stream(http, url, body, out, flags[i])))
            else:
                tasks.append(asyncio.create_task(_plain(http, url, body, out)))
            if i == RUNNING_STREAMS - 1:
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 120)
            elif i == RUNNING - 1:
                await wait_for_metric("num_requests_running", RUNNING)
        await wait_for_metric("num_requests_waiting", QUEUED)
        assert not any(t.done() for t in tasks), "a request ended before the fault"
        await asyncio.to_thread(fault)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return outs


def test_worker_death_with_a_long_queue_turns_health_503_first_and_logs_one_line_per_request(tmp_path, tiny_model):
    """kill -9 of the worker with 3 streams and 1 non-streaming request running and 176 requests
    queued behind them: /health answers 503 within 2 s of the kill and no probe waits more than 1 s
    (failing the requests never holds the event loop); every request, running or queued, ends with a
    clean error; the server exits 1 with no orphan and no socket directory (outcome: clean exit, the
    KV state died with the worker); the server's log holds at most one traceback and exactly one
    line per failed request."""
    srv = start_server(tmp_path, tiny_model, "--max-running-requests", str(RUNNING))
    probes: list[tuple[float, float, int]] = []       # (since the kill, latency, status)

    def kill_worker_and_probe() -> None:
        os.kill(srv.child("worker"), signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 3.0:
            sent = time.monotonic()
            status = PROBE.get(f"{srv.base_url}/health", timeout=10).status_code
            probes.append((sent - killed, time.monotonic() - sent, status))
            if status == 503:
                return
            time.sleep(0.05)

    try:
        assert len(srv.child_pids) == 2
        outs = asyncio.run(_queue_then(srv, kill_worker_and_probe))
        first_503 = next((at + latency for at, latency, status in probes if status == 503), None)
        assert first_503 is not None and first_503 < 2.0, probes
        assert max(latency for _, latency, _ in probes) < 1.0, probes
        _assert_clean_errors(outs, "worker")
        _assert_clean_exit(srv)
        log = (srv.tmp_dir / "server.log").read_text(errors="replace")
        assert log.count("Traceback") <= 1, log[-3000:]
        failed = re.findall(r"request \d+ failed: the runtime died: the worker process", log)
        assert len(failed) == len(outs), log[-3000:]
    finally:
        srv.stop()


# -- corrupted frames: recovery ------------------------------------------------------------------


def bad_frames() -> dict[str, list[bytes]]:
    """Per inbox (named by its socket file): garbage, a truncated message, another channel's message
    and a message of the channel's own type union that the protocol does not expect there."""
    enc = encoder().encode
    step = enc(WorkerStep(StepPlan(10**6, released=[], decodes=[1, 2, 3])))
    generate = enc(GenerateRequest(10**6, list(range(50)), SamplingParams(max_tokens=4)))
    garbage = [b"", b"\xc1", os.urandom(64), b"\x92\xa4junk"]
    return {
        "frontend_to_scheduler": [*garbage, generate[: len(generate) // 2], enc(WorkerReady(1, 1, 1, [])),
                                  msgspec.msgpack.encode({"type": "generate", "rid": "x"})],
        "worker_to_scheduler": [*garbage, step[:7], generate, enc(WorkerReady(4, 4, 4, [0])),
                                enc(RuntimeReady(1, 1, 1))],
        "scheduler_to_worker": [*garbage, step[: len(step) - 3], enc(AbortRequest(1)),
                                enc(StatsRequest(1))],
        "scheduler_to_frontend": [*garbage, enc(StatsRequest(2))[:3], generate, enc(RuntimeReady(1, 1, 1))],
    }


def send_frames(ipc_dir: Path, frames: dict[str, list[bytes]]) -> None:
    ctx = zmq.Context()
    try:
        for name, payloads in frames.items():
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 5000)
            sock.connect(f"ipc://{ipc_dir / name}")
            for payload in payloads:
                sock.send(payload)
            sock.close()                 # lingers until delivered
    finally:
        ctx.term()


def test_corrupted_frames_on_every_inbox_are_dropped_and_serving_goes_on(shared):
    """Bad frames on the four inboxes (scheduler: from the frontend and from the worker; worker:
    from the scheduler; server: from the scheduler) while 8 streams and 2 non-streaming requests
    run. Outcome: recovery. Each frame is logged and dropped; the requests finish normally; the
    children keep their pids; a new request is served; /metrics counts every dropped frame and the
    KV audit still passes."""
    srv = shared.get()
    [ipc_dir] = socket_dirs(srv)
    frames = bad_frames()
    before = metric(srv.base_url, "malformed_frames_total")
    outs = asyncio.run(under_load(srv.base_url, 128, lambda: send_frames(ipc_dir, frames)))
    for out in outs:
        assert out.error is None and out.status == 200, (out.status, out.events[-2:])
        if out.stream:
            assert out.events[-1] == "[DONE]"
            assert json.loads(out.events[-2])["choices"][0]["finish_reason"] == "length"
            assert not any('"error"' in e for e in out.events)
        else:
            assert json.loads(out.events[0])["choices"][0]["finish_reason"] == "length"
    assert all(pid_alive(p) for p in srv.child_pids) and srv.proc.poll() is None
    assert PROBE.get(f"{srv.base_url}/health").status_code == 200
    r = PROBE.post(f"{srv.base_url}/v1/completions", json={**BODY, "prompt": "After the storm", "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    # The worker reports its count with its next step output: the request above made one.
    assert metric(srv.base_url, "malformed_frames_total") - before == sum(map(len, frames.values()))
    assert metric(srv.base_url, "kv_integrity_ok") == 1.0
    assert metric(srv.base_url, "kv_idle_baseline") == 1.0
    assert srv.read_log().count("dropped a malformed frame") >= 1


# -- KV oversubscription: no fault ---------------------------------------------------------------


OVERSUB_PROMPTS = [f"Item {i}: a list of the colours of the rainbow, with a short note on each colour and on where "
                   "it sits in the bow" for i in range(4)]
OVERSUB_TOKENS = 69            # + 28 prompt tokens - 1: 96 positions, 6 pages of 16; 4 requests: 24 pages
# 8 pages: a third of the demand. Requests are admitted while their prompt pages and decode reserve (a
# share of max_tokens) fit, and outgrow the pool as they decode: the newest are retracted, to resume from
# their tokens once others finish. (The pool also holds the scheduler fault's requests of 110 tokens.)
OVERSUB_POOL_TOKENS = 128


async def _greedy_all(base_url: str) -> list[tuple[int, list[str]] | str]:
    """Per prompt: (KV pages it needs, its greedy tokens), or the error it got."""
    async with httpx.AsyncClient(timeout=180) as http:
        async def one(prompt: str) -> tuple[int, list[str]] | str:
            r = await http.post(f"{base_url}/v1/completions", json={
                **BODY, "prompt": prompt, "max_tokens": OVERSUB_TOKENS, "logprobs": 0})
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {r.text}"
            choice, usage = r.json()["choices"][0], r.json()["usage"]
            assert choice["finish_reason"] == "length" and usage["completion_tokens"] == OVERSUB_TOKENS
            return -(-(usage["prompt_tokens"] + OVERSUB_TOKENS - 1) // 16), choice["logprobs"]["tokens"]
        return await asyncio.wait_for(asyncio.gather(*map(one, OVERSUB_PROMPTS)), 240)


def test_kv_oversubscribed_3x_completes_with_unchanged_greedy_outputs(shared, small):
    """A 128-token KV pool (8 pages) and 4 concurrent requests needing 6 pages each (3x the pool):
    every request completes, without errors, with the same greedy tokens as on a 32K-token pool;
    retraction did the work (the counter moved) and the small server ends at its idle baseline."""
    reference = asyncio.run(_greedy_all(shared.get().base_url))
    assert all(isinstance(r, tuple) for r in reference), reference
    assert sum(pages for pages, _ in reference) >= 3 * OVERSUB_POOL_TOKENS // 16
    srv = small.get()
    assert metric(srv.base_url, "kv_total_pages") == OVERSUB_POOL_TOKENS // 16    # page size 16
    got = asyncio.run(_greedy_all(srv.base_url))
    assert got == reference
    assert metric(srv.base_url, "retractions_total") > 0
    assert metric(srv.base_url, "kv_idle_baseline") == 1.0
    assert metric(srv.base_url, "kv_integrity_ok") == 1.0


# -- the last tests end the shared servers: clean exits -------------------------------------------


def test_kill_scheduler_under_load_exits_cleanly(small):
    """kill -9 of the scheduler with a stream and a non-streaming request in flight (on the 8-page
    server: its requests' decode reserve admits few, and the fault needs no more): every request ends
    with a clean error, /health turns 503 within 2 s, the server exits 1 with no orphan and no socket
    directory. Outcome: clean exit (no recovery: the request table died with the scheduler). The
    worker's kill, with the same assertions, is the long-queue test's fault above."""
    srv = small.take()
    try:
        assert len(srv.child_pids) == 2
        outs = asyncio.run(under_load(srv.base_url, 110, lambda: _kill_and_watch_health(srv, "scheduler"),
                                      streams=1, plain=1))
        _assert_clean_errors(outs, "scheduler")
        _assert_clean_exit(srv)
    finally:
        srv.stop()




def test_stopped_worker_under_load_turns_health_503_within_two_seconds(shared):
    """SIGSTOP of the worker (a child that stops running, as a frozen process does) with streams in
    flight: /health turns 503 within 2 s (its heartbeat goes stale), every request ends with a clean
    error, the server exits 1 and the stopped child is not left behind."""
    srv = shared.take()

    def stop_worker_and_watch_health() -> None:
        os.kill(srv.child("worker"), signal.SIGSTOP)
        stopped = time.monotonic()
        while PROBE.get(f"{srv.base_url}/health", timeout=5).status_code != 503:
            assert time.monotonic() - stopped < 2.0, "/health still 200 two seconds after the worker stopped"
            time.sleep(0.05)

    try:
        assert len(srv.child_pids) == 2
        outs = asyncio.run(under_load(srv.base_url, 2000, stop_worker_and_watch_health))
        for out in outs:
            assert out.error is None, out.error
            if out.stream:
                assert out.events[-1] == "[DONE]" and "has not run for" in out.events[-2], out.events[-2:]
            else:
                assert out.status == 503 and "has not run for" in out.events[0], out.events
        _assert_clean_exit(srv)
    finally:
        srv.stop()
