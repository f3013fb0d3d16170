"""Hand-written hostile requests against the real server (``hostile.corpus``): each gets the
status it must (a 4xx OpenAI error naming the field where one is at fault, or a 200 where the
input is in fact valid), never a 5xx or a hang; the server stays healthy and serves a normal request
afterwards. Also: template injection in messages stays text, and a hostile ``--chat-template`` is
refused at start-up or per request, never executed."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.runtime.server_process import ServerProcess, pid_alive
from tests.server.conftest import MODEL, OPEN_SESAME
from tests.server.hostile import Hostile, Tally, check_alive, corpus, is_openai_error, send_corpus

pytestmark = pytest.mark.timeout(300)
ESCAPE_MARK = Path("/tmp/radixrelay-template-escaped")


@pytest.fixture
def http(hostile_server):
    with httpx.Client(base_url=hostile_server.base_url, timeout=60) as h:
        yield h


def test_hostile_corpus(http):
    ESCAPE_MARK.unlink(missing_ok=True)
    wrong: list[str] = []

    def judge(case: Hostile, response: httpx.Response | None) -> None:
        if response is None or response.status_code != case.expect:
            got = "no answer" if response is None else f"{response.status_code} {response.text[:200]}"
            wrong.append(f"{case.name}: expected {case.expect}, got {got}")
        elif case.param is not None and response.json()["error"]["param"] != case.param:
            wrong.append(f"{case.name}: param {response.json()['error']['param']!r}, not {case.param!r}")

    tally = Tally()
    cases = corpus(MODEL)
    send_corpus(http, cases, tally, judge)
    check_alive(http, MODEL, tally)
    assert wrong == []
    assert tally.tried == len(cases) >= 80
    assert tally.server_errors == tally.hangs == 0 and tally.problems == []
    assert tally.health_passed == 1
    assert not ESCAPE_MARK.exists()


def test_template_injection_in_messages_is_text(http):
    loop = "{% for i in range(3000) %}word {% endfor %}"
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": loop}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] < 100          # executed, it would be 3,000+ tokens


def test_hostile_template_branch_is_refused_per_request(http):
    ESCAPE_MARK.unlink(missing_ok=True)
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": OPEN_SESAME}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and is_openai_error(r.content, r.headers["content-type"])
    assert "unsafe" in r.json()["error"]["message"]
    assert not ESCAPE_MARK.exists()
    assert check_alive(http, MODEL, Tally())


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch /tmp/radixrelay-template-escaped').read() }}",
    "{% for m in messages %}{{ m.content * 100000000 }}{% endfor %}",
])
def test_unsafe_chat_template_is_refused_at_startup(tmp_path, template):
    ESCAPE_MARK.unlink(missing_ok=True)
    srv = ServerProcess(tmp_path, "--chat-template", template)
    try:
        with pytest.raises(RuntimeError, match="server exited with 2"):
            srv.wait_ready()
        assert "the given chat template (--chat-template) is unsafe" in srv.read_log()   # not the model's
        assert srv.child_pids == [] and all(not pid_alive(p) for p in srv.child_pids)
    finally:
        srv.stop()
    assert not ESCAPE_MARK.exists()
