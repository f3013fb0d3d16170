"""Prompts far over the context, on a real server: a burst of multi-megabyte prompts is refused with
400s while /health and normal requests keep being answered at once, and the server's memory comes
back afterwards; a prompt a little over the context still gets the exact token count. The server runs
the tiny dummy model of ``tests/runtime/server_process.py`` (the default model's tokenizer and context:
what is tested is the frontend's)."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from radixrelay.text.tokenizer import load_tokenizer
from tests.runtime.server_process import ServerProcess
from tests.text.test_tokenizer import default_gguf

pytestmark = pytest.mark.timeout(600)
CONTEXT = 8192                     # the default model's, and the tiny model's
BURST = 8
PROMPT_CHARS = 3_600_000


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    srv = ServerProcess(tmp_path_factory.mktemp("long"), *tiny_model, "--kv-cache-tokens", "4096")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def words(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(5000)]
    out = " ".join(rng.choice(vocab) for _ in range(chars // 5))
    return out[:chars]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text[:300]
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_a_burst_of_huge_prompts_blocks_nobody(server) -> None:
    url = server.base_url
    # Distinct texts (nothing shared through the encode cache): six completions, two chats; one
    # completion under the character bound, so it is refused by counting its first tokens.
    prompts = [words(i, PROMPT_CHARS if i != 1 else 1_200_000) for i in range(BURST)]
    # Encoded up front: the test process's own JSON work must not delay its /health probes.
    bodies = [("/v1/completions", {"model": "default", "prompt": p, "max_tokens": 4}) for p in prompts[:6]]
    bodies += [("/v1/chat/completions",
                {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": p}]})
               for p in prompts[6:]]
    payloads = [(path, json.dumps(body).encode()) for path, body in bodies]
    del prompts, bodies
    with httpx.Client(base_url=url, timeout=60) as h:
        h.post("/v1/completions", json={"model": "default", "prompt": "Hello", "max_tokens": 2})
    before = rss_mib(server.proc.pid)

    done = threading.Event()
    health: list[float] = []
    normal: list[tuple[int, float]] = []

    def poll_health() -> None:
        with httpx.Client(base_url=url, timeout=30) as h:
            while not done.is_set():
                t0 = time.monotonic()
                assert h.get("/health").status_code == 200
                health.append(time.monotonic() - t0)
                time.sleep(0.05)

    def post(payload: tuple[str, bytes]) -> httpx.Response:
        with httpx.Client(base_url=url, timeout=120) as h:
            return h.post(payload[0], content=payload[1], headers={"content-type": "application/json"})

    def normal_request() -> None:
        time.sleep(0.3)                  # while the burst is being worked on
        with httpx.Client(base_url=url, timeout=120) as h:
            t0 = time.monotonic()
            r = h.post("/v1/completions", json={"model": "default", "prompt": "Say hi", "max_tokens": 2})
            normal.append((r.status_code, time.monotonic() - t0))

    poller = threading.Thread(target=poll_health)
    poller.start()
    side = threading.Thread(target=normal_request)
    side.start()
    try:
        with ThreadPoolExecutor(BURST) as pool:
            responses = list(pool.map(post, payloads))
        side.join()
    finally:
        done.set()
        poller.join()
    for i, r in enumerate(responses):
        err = error_of(r)
        assert err["param"] == ("messages" if i >= 6 else "prompt")
        assert err["message"] == (f"the prompt has more than {2 * CONTEXT} tokens; this model's context "
                                  f"is {CONTEXT} tokens"), err
    assert len(health) >= 3 and max(health) < 1.0, sorted(health)[-5:]
    assert normal and normal[0][0] == 200 and normal[0][1] < 10, normal

    del responses, payloads
    time.sleep(2)
    after = rss_mib(server.proc.pid)
    assert after - before < 150, (before, after)


def test_a_prompt_a_little_over_the_context_gets_its_exact_count(server) -> None:
    text = words(99, 24_000)
    n = len(load_tokenizer(default_gguf()).encode(text))
    assert CONTEXT < n < 2 * CONTEXT
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                   json={"model": "default", "prompt": text, "max_tokens": 4})
    assert error_of(r)["message"] == f"the prompt has {n} tokens; this model's context is {CONTEXT} tokens"
