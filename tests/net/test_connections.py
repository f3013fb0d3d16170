"""The connection limits (``radixrelay.net.connections``) in both uvicorn protocols, httptools' and h11's, over
real sockets against a stand-in app process (``stand_in_app``), and the log's rate limit (``log_limits``)."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from radixrelay.net.connections import ConnectionLimits, default_max_connections
from radixrelay.net.log_limits import RateLimitFilter
from tests.net.sockets import (
    PARTIAL_BODY, PARTIAL_HEAD, close_all, open_conns, post_head, raise_fd_limit, send_slowly, wait_closed,
)
from tests.net.stand_in_app import StandInProcess

DEADLINE_S = 0.5
CAP = 20
GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"


@pytest.fixture(scope="module", params=["httptools", "h11"])
def app(request, tmp_path_factory):
    srv = StandInProcess(tmp_path_factory.mktemp(request.param), "--http", request.param,
                         "--request-read-timeout", str(DEADLINE_S), "--max-connections", str(CAP))
    srv.impl = request.param
    yield srv
    srv.stop()


def test_half_sent_requests_get_408_at_the_deadline(app):
    conns = open_conns(app.port, 12, (PARTIAL_HEAD, PARTIAL_BODY, b""))     # b"": a connection that sends nothing
    assert wait_closed(conns, DEADLINE_S + 5) == []
    for c in conns:
        assert c.status() == 408, c.data
        assert c.error()["code"] == "request_timeout"
        assert DEADLINE_S - 0.05 <= c.closed - c.opened <= DEADLINE_S + 3


def test_a_slow_whole_body_within_the_deadline_is_answered(app):
    body = json.dumps({"text": "x" * 400}).encode()
    c = send_slowly(app.port, post_head("/echo", body), body, pieces=4, pause_s=DEADLINE_S / 6)
    assert c.status() == 200, c.data
    assert json.loads(c.data.split(b"\r\n\r\n", 1)[1]) == {"bytes": len(body)}


def test_a_stream_longer_than_the_deadline_is_not_cut(app):
    body = json.dumps({"stream": True, "stand_in_chunks": 6, "stand_in_delay": 0.25}).encode()
    start = time.monotonic()
    c = open_conns(app.port, 1, (post_head("/v1/chat/completions", body) + body,))[0]
    assert wait_closed([c], 20) == []
    assert c.closed - start > 3 * DEADLINE_S
    assert c.status() == 200 and c.data.count(b"data: {") == 6 and b"data: [DONE]" in c.data


def test_each_request_of_a_kept_alive_connection_has_its_deadline(app):
    # idle between requests is uvicorn's keep-alive (5 s), not the deadline: a second request past it is answered
    c = open_conns(app.port, 1, (GET_HEALTH,))[0]
    time.sleep(DEADLINE_S + 0.3)
    c.sock.sendall(GET_HEALTH)
    time.sleep(0.3)
    c.sock.sendall(PARTIAL_HEAD)          # the third request's deadline starts with its first byte
    sent = time.monotonic()
    assert wait_closed([c], DEADLINE_S + 5) == []
    assert c.data.count(b"HTTP/1.1 200 OK") == 2 and b"HTTP/1.1 408" in c.data, c.data
    assert c.closed - sent >= DEADLINE_S - 0.05


def test_a_pipelined_half_request_waits_for_the_stream_before_it(app):
    body = json.dumps({"stream": True, "stand_in_chunks": 5, "stand_in_delay": 0.25}).encode()
    c = open_conns(app.port, 1, (post_head("/v1/chat/completions", body, close=False) + body + PARTIAL_HEAD,))[0]
    assert wait_closed([c], 20) == []
    done = c.data.find(b"data: [DONE]")
    assert done > 0 and c.data.count(b"data: {") == 5, c.data
    assert c.data.find(b"HTTP/1.1 408") > done          # the stream whole, then the half request's 408


def test_connections_past_the_cap_get_503_at_once(app):
    held = open_conns(app.port, CAP)                     # silent: closed by the deadline, not before the test
    time.sleep(0.1)
    over = open_conns(app.port, 3, (GET_HEALTH,))
    try:
        assert wait_closed(over, 2) == []
        for c in over:
            assert c.status() == 503, c.data
            assert c.error()["code"] == "too_many_connections"
            assert c.closed - c.opened < 0.5
    finally:
        close_all(held + over)
    time.sleep(0.2)                                       # their connection_lost frees the cap again
    assert httpx.get(f"{app.url}/health", timeout=5).status_code == 200


def test_a_request_head_over_the_limit_is_refused(app):
    c = open_conns(app.port, 1, (b"GET /health HTTP/1.1\r\nHost: test\r\nX-Big: ",))[0]
    for _ in range(12):                                   # 192 KB of one header, in reads of its own
        time.sleep(0.01)
        try:
            c.sock.sendall(b"a" * 16384)
        except OSError:                                   # refused already
            break
    assert wait_closed([c], 5) == []
    # httptools: our 431; h11 refuses a head over its 16 KiB itself (uvicorn's 400)
    assert c.status() == (431 if app.impl == "httptools" else 400), c.data[:200]


def test_large_bodies_are_not_taken_for_heads(app):
    """Kept-alive requests whose bodies arrive in large reads: the head limit counts head bytes only."""
    body = json.dumps({"text": "x" * 300_000}).encode()
    one = post_head("/echo", body, close=False) + body
    c = open_conns(app.port, 1, (one + one + one,))[0]
    time.sleep(0.3)
    c.sock.sendall(GET_HEALTH[:-2] + b"Connection: close\r\n\r\n")
    assert wait_closed([c], 10) == []
    assert c.data.count(b"HTTP/1.1 200 OK") == 4, c.data[:300]
    assert c.data.count(b'{"bytes": %d}' % len(body)) == 3


def test_the_log_has_a_line_per_cause_not_per_connection(app):
    conns = open_conns(app.port, CAP - 2, (PARTIAL_HEAD, b"NOT HTTP AT ALL\r\n\r\n"))
    assert wait_closed(conns, DEADLINE_S + 5) == []
    assert {c.status() for c in conns} == {408, 400}      # uvicorn's own 400 for what is not HTTP
    time.sleep(0.2)
    lines = app.log.read_text().splitlines()
    assert "Traceback" not in "\n".join(lines)
    # one line per cause (and a summary if 10 s went by): uvicorn's, and the deadline's and the cap's
    assert sum("Invalid HTTP request" in line for line in lines) <= 2, lines
    assert sum("408" in line for line in lines) <= 2, lines
    assert sum("503" in line for line in lines) <= 2, lines


def test_running_out_of_descriptors_logs_a_line_not_a_traceback_per_accept(tmp_path):
    """Past the descriptor limit (here 600, with a cap of 300 that leaves no room for an accept burst),
    asyncio's accept loop fails once per queued connection, each a traceback logged: bounded to a line."""
    raise_fd_limit(3000)
    srv = StandInProcess(tmp_path, "--fd-limit", "600", "--max-connections", "300", "--request-read-timeout", "30")
    try:
        conns = open_conns(srv.port, 1500)
        time.sleep(1.5)
        close_all(conns)
        end = time.monotonic() + 20
        while True:                                   # it serves again once the flood is gone
            try:
                if httpx.get(f"{srv.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < end, srv.log.read_text()[-2000:]
        lines = srv.log.read_text().splitlines()
        assert "Traceback" not in "\n".join(lines)
        assert sum("out of system resource" in line for line in lines) <= 2, lines
        assert len(lines) < 20, lines
    finally:
        srv.stop()


# -- the parts alone ---------------------------------------------------------------------------------------


def test_limits_are_checked():
    for bad in ({"read_timeout_s": 0}, {"read_timeout_s": float("nan")}, {"read_timeout_s": float("inf")},
                {"max_connections": 0}, {"max_connections": 1.5}, {"fds_per_connection": 3}):
        with pytest.raises(ValueError):
            ConnectionLimits(**bad)
    with pytest.raises(ValueError, match="descriptor limit"):
        ConnectionLimits(max_connections=10 ** 9).resolved()
    resolved = ConnectionLimits(fds_per_connection=2).resolved()
    assert 1 <= resolved.max_connections
    assert default_max_connections(20000) == 20000 - 3072
    assert default_max_connections(20000, 2) == (20000 - 3072) // 2
    assert default_max_connections(1024) == 512                         # at most half kept back
    assert default_max_connections(1 << 20) == 65536                    # the ceiling


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def limited_logger():
    log = logging.getLogger("tests.net.rate_limited")
    log.propagate = False
    handler, flt = _Records(), RateLimitFilter(interval_s=0.3)
    log.addHandler(handler)
    log.addFilter(flt)
    yield log, handler.records
    log.removeHandler(handler)
    log.removeFilter(flt)


def test_the_rate_limit_passes_one_record_per_cause_and_counts_the_rest(limited_logger):
    log, records = limited_logger
    for i in range(1000):
        log.warning("closed a connection from %s", f"10.0.0.{i % 250}")
        log.warning("another cause %d", i)
    assert [r.getMessage() for r in records] == ["closed a connection from 10.0.0.0", "another cause 0"]
    time.sleep(0.5)                                   # the window ends: one summary line per cause
    summaries = sorted(r.getMessage() for r in records[2:])
    assert summaries == ["999 more like this in 0.3 s: another cause 0",
                         "999 more like this in 0.3 s: closed a connection from 10.0.0.0"]
    log.warning("closed a connection from %s", "10.0.0.9")          # a new window: passes again
    assert records[-1].getMessage() == "closed a connection from 10.0.0.9"


def test_an_os_error_is_logged_in_one_line(limited_logger):
    log, records = limited_logger
    try:
        raise OSError(24, "Too many open files")
    except OSError:
        log.error("socket.accept() out of system resource\nsocket: <fd=6>", exc_info=True)
    [record] = records
    assert record.exc_info is None
    assert record.getMessage() == ("socket.accept() out of system resource; socket: <fd=6> "
                                   "(OSError: [Errno 24] Too many open files)")
