"""The router's limits as a proxy, against a stand-in replica (``tests/router/stand_in.py``: a real HTTP server
that answers huge, hangs, redirects, dies mid-stream or echoes the headers it saw) behind a real
``radixrelay router`` process: request bodies over ``--max-body-bytes`` are refused (from Content-Length
first, then while reading), bodies the router cannot use are 400s, answers over ``--max-response-bytes``
are a 502, a replica silent for ``--upstream-read-timeout`` is a 504 (or an error event and ``[DONE]`` in a
stream), a redirect is a 502 and never followed, ``Authorization`` reaches the replica on every path
(``/v1/models`` included), past ``--max-in-flight`` the router answers 429 itself, a client leaving a stream
is counted, every error is OpenAI's error JSON, and health polls do not log."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.router.router_process import RouterProcess
from tests.router.stand_in import StandIn

pytestmark = pytest.mark.timeout(120)

KEY = "sekret"
BODY_CAP = 1 << 20
RESPONSE_CAP = 1 << 20
READ_TIMEOUT_S = 1.5
MAX_IN_FLIGHT = 4
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def replica():
    stand_in = StandIn(api_key=KEY)
    yield stand_in
    stand_in.stop()


@pytest.fixture(scope="module")
def router(replica, tmp_path_factory):
    r = RouterProcess(tmp_path_factory.mktemp("limits"), replica.url, log_level="info",
                      extra=("--max-body-bytes", str(BODY_CAP), "--max-response-bytes", str(RESPONSE_CAP),
                             "--upstream-read-timeout", str(READ_TIMEOUT_S), "--upstream-connect-timeout", "2",
                             "--max-in-flight", str(MAX_IN_FLIGHT)))
    yield r
    r.stop()


def _post(router: RouterProcess, body, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{router.base_url}{path}", content=content, timeout=30,
                      headers={**AUTH, "content-type": "application/json", **kwargs.pop("headers", {})}, **kwargs)


def _error(reply: httpx.Response, status: int) -> dict:
    """The OpenAI error object of ``reply``, which must have ``status``."""
    assert reply.status_code == status, (reply.status_code, reply.text[:300])
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _sse(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def _read_answer(sock: socket.socket) -> str:
    """One HTTP answer with a Content-Length, as text, read off ``sock``."""
    def more() -> bytes:
        data = sock.recv(65536)
        assert data, "the connection closed before the whole answer"
        return data

    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += more()
    return (head + b"\r\n\r\n" + body).decode()


def _wait_for(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_authorization_reaches_the_replica_on_every_path(router, replica):
    client = router.client(api_key=KEY)
    assert [m.id for m in client.models.list()] == ["m"]
    with pytest.raises(openai.AuthenticationError):                 # the replica's 401, passed through
        router.client(api_key="wrong").models.list()
    echoed = _post(router, {"model": "echo", "prompt": "hi"}, headers={"accept": "application/json"}).json()
    assert echoed["headers"] == {"authorization": f"Bearer {KEY}", "content-type": "application/json",
                                 "accept": "application/json"}


def test_a_body_over_the_cap_is_refused_before_it_is_read(router, replica):
    before = len(replica.seen)
    # Content-Length alone says it is too large: answered at once, no body sent
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n")
        answer = _read_answer(sock)
    assert answer.startswith("HTTP/1.1 413") and "request_too_large" in answer, answer
    # chunked (no Content-Length): refused once what was read passes the cap

    def chunks():
        yield b'{"model": "echo", "prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    try:
        reply = httpx.post(f"{router.base_url}/v1/completions", content=chunks(), headers=AUTH, timeout=10)
        assert _error(reply, 413)["code"] == "request_too_large"
    except httpx.TransportError:
        pass                                         # closed while the client was still sending: refused too
    assert len(replica.seen) == before
    assert httpx.get(f"{router.base_url}/health", timeout=2).status_code == 200
    # under the cap, a large body (parsed off the event loop) goes through whole
    body = {"model": "echo", "prompt": "y" * (BODY_CAP - 1000)}
    assert _post(router, body).json()["bytes"] == len(json.dumps(body))


@pytest.mark.parametrize("raw, why", [
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
    (b'{"model": "echo", "messages": ' + b"[" * 990 + b"]" * 990 + b"}", None),
    (json.dumps({"model": "echo", "prompt": [1, 2 ** 64, 3]}).encode(), "token ids"),
    (json.dumps({"model": "echo", "prompt": [-1] * 100}).encode(), "token ids"),
    (b'{"model": "echo", "prompt": [' + b"9" * 5000 + b"]}", None),
    (b"[1, 2]", "JSON object"),
    (b"\xff\xfe{}", "not JSON"),
    (b"{not json", "not JSON"),
])
def test_bodies_the_router_cannot_use_are_400s(router, replica, raw, why):
    before = len(replica.seen)
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    error = _error(_post(router, raw, path=path), 400)
    assert error["type"] == "invalid_request_error"
    assert why is None or why in error["message"], error
    assert len(replica.seen) == before


@pytest.mark.parametrize("model", ["huge", "huge-chunked"])
def test_an_answer_over_the_cap_is_a_502_and_the_upstream_is_closed(router, replica, model):
    # more than the loopback's socket buffers hold: the replica is still writing when the router closes
    error = _error(_post(router, {"model": model, "size": 32 * RESPONSE_CAP}), 502)
    assert error["code"] == "upstream_response_too_large"
    if model == "huge-chunked":                      # the router stopped reading: the replica's writes failed
        assert _wait_for(lambda: model in replica.closed)
    assert _post(router, {"model": "huge", "size": RESPONSE_CAP // 2}).content == b"x" * (RESPONSE_CAP // 2)


def test_a_silent_replica_is_a_504_and_its_connection_is_closed(router, replica):
    start = time.monotonic()
    error = _error(_post(router, {"model": "hang"}), 504)
    took = time.monotonic() - start
    assert error["code"] == "upstream_timeout" and READ_TIMEOUT_S <= took < READ_TIMEOUT_S + 3, took
    assert _wait_for(lambda: "hang" in replica.closed)
    # in a stream: what came, then an error event and [DONE]
    with httpx.stream("POST", f"{router.base_url}/v1/completions", headers=AUTH, timeout=30,
                      json={"model": "hang-stream", "stream": True}) as reply:
        events = _sse(reply.iter_lines())
    assert json.loads(events[0])["choices"][0]["text"] == " t0"
    assert json.loads(events[1])["error"]["code"] == "upstream_timeout"
    assert events[2:] == ["[DONE]"]
    assert httpx.get(f"{router.base_url}/health", timeout=2).status_code == 200     # still in the pool


def test_a_redirect_is_a_502_and_never_followed(router, replica):
    error = _error(_post(router, {"model": "redirect"}), 502)
    assert error["code"] == "upstream_redirect"
    time.sleep(0.2)
    assert ("/landing", "redirect") not in replica.seen


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_and_done(router, replica):
    with httpx.stream("POST", f"{router.base_url}/v1/completions", headers=AUTH, timeout=30,
                      json={"model": "die-stream", "stream": True}) as reply:
        assert reply.status_code == 200
        events = _sse(reply.iter_lines())
    assert json.loads(events[0])["choices"][0]["text"] == " t0"
    assert json.loads(events[-2])["error"]["type"] == "upstream_error"
    assert events[-1] == "[DONE]"
    assert _wait_for(lambda: httpx.get(f"{router.base_url}/health", timeout=2).status_code == 200)


def test_a_client_leaving_a_stream_is_counted_and_closes_the_upstream(router, replica):
    counter = "radixrelay_router_client_disconnects_total"
    before = router.metric(counter)
    with httpx.stream("POST", f"{router.base_url}/v1/completions", headers=AUTH, timeout=30,
                      json={"model": "slow-stream", "stream": True}) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
        next(lines)
    assert _wait_for(lambda: router.metric(counter) == before + 1), router.metrics()
    assert _wait_for(lambda: "slow-stream" in replica.closed)
    assert router.metric('radixrelay_router_replica_in_flight{') == 0


def test_a_client_leaving_mid_body_is_counted_not_logged(router):
    counter = "radixrelay_router_client_disconnects_total"
    before = router.metric(counter)
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.3)
    assert _wait_for(lambda: router.metric(counter) == before + 1), router.metrics()
    log = router.log_path.read_text()
    assert "Traceback" not in log and "unexpected" not in log.lower(), log[-2000:]


def test_past_the_in_flight_cap_the_router_answers_429_itself(router, replica):
    hangs = replica.seen.count(("/v1/completions", "hang"))
    with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        held = [pool.submit(_post, router, {"model": "hang"}) for _ in range(MAX_IN_FLIGHT)]
        assert _wait_for(lambda: replica.seen.count(("/v1/completions", "hang")) == hangs + MAX_IN_FLIGHT)
        before = len(replica.seen)
        error = _error(_post(router, {"model": "echo"}), 429)
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert len(replica.seen) == before
        assert all(f.result().status_code == 504 for f in held)
    assert _post(router, {"model": "echo"}).status_code == 200


def test_routing_errors_are_openai_json(router):
    assert _error(httpx.get(f"{router.base_url}/nowhere", timeout=5), 404)["code"] == "not_found"
    assert _error(httpx.get(f"{router.base_url}/v1/completions", timeout=5), 405)["code"] == "method_not_allowed"


def test_health_polls_do_not_log(router):
    time.sleep(1.0)                                  # two polls at least, on top of the tests above
    log = router.log_path.read_text()
    assert "HTTP Request" not in log and "/health" not in log, log[-2000:]


def test_the_limits_are_the_server_s_and_bad_values_are_refused_at_start():
    from radixrelay.cli import _parser
    from radixrelay.config import ServerConfig
    from radixrelay.router.proxy import ProxyLimits

    args = _parser().parse_args(["router", "--replica", "http://127.0.0.1:1"])
    defaults = ProxyLimits()
    assert args.max_body_bytes == ServerConfig.max_body_bytes == defaults.max_body_bytes
    for field in ("max_response_bytes", "upstream_connect_timeout", "upstream_read_timeout", "max_in_flight"):
        assert getattr(args, field) == getattr(defaults, field), field
    for field, value in (("max_body_bytes", 10), ("max_response_bytes", 0), ("upstream_read_timeout", 0.0),
                         ("upstream_connect_timeout", float("inf")), ("max_in_flight", 0)):
        with pytest.raises(ValueError, match=field.replace("_", "-")):
            ProxyLimits(**{field: value})
    done = subprocess.run([sys.executable, "-m", "radixrelay.cli", "router", "--replica", "http://127.0.0.1:1",
                           "--max-in-flight", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "radixrelay router: error: --max-in-flight must be >= 1" in done.stderr
