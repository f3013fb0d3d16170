"""``radixrelay router`` in front of two real servers (CPU; the tiny dummy model of
``tests/runtime/server_process.py``: routing does not depend on the model's words), through the official
``openai`` client: repeated prefixes of several tenants go to the replica that holds them (checked by
the replicas' ``cached_tokens``), salts do not share routes, streams pass through as the replica sends
them, a client that disconnects aborts its request on the replica, a killed replica leaves the pool
within two seconds (its stream in flight ends with an error, later
requests go to the other), bad replica URLs are refused at start."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from radixrelay.cli import main
from tests.router.redis_server import redis_store  # noqa: F401 - a fixture
from tests.router.router_process import RouterProcess
from tests.runtime.server_process import ServerProcess, pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Three tenants: an odd count, so that the replicas each tenant's later requests must go to (the one
# that computed its prefix) differ from what alternating between the two would give. Each system prompt
# is ~280 tokens: more than one request in flight is worth (LOAD_TOKENS, radixrelay/router/routing.py), so
# a replica's load as last reported does not outweigh the prefix it holds.
TENANTS = [f"You are the assistant of tenant {t}. " + " ".join(f"rule{t}x{i} applies;" for i in range(40))
           for t in range(3)]


@pytest.fixture(scope="module")
def store(redis_store):
    return redis_store


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> str:
    """The key the replicas sign their KV events with and the precise routers check them by."""
    path = tmp_path_factory.mktemp("key") / "kv-events.key"
    path.write_text("a test key of thirty-two bytes..\n")
    return str(path)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, store, key_file, tiny_model):
    servers = [ServerProcess(tmp_path_factory.mktemp(f"replica{i}"), *tiny_model, "--kv-cache-tokens", "8192",
                             "--kv-events", store.url, "--kv-events-key-file", key_file) for i in range(2)]
    try:
        yield [s.wait_ready() for s in servers]
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    r = RouterProcess(tmp_path_factory.mktemp("router"), *(s.base_url for s in replicas))
    yield r
    r.stop()


@pytest.fixture(scope="module")
def precise(replicas, store, key_file, tmp_path_factory):
    r = RouterProcess(tmp_path_factory.mktemp("precise"), *(s.base_url for s in replicas), mode="precise",
                      store=store.url, extra=("--store-key-file", key_file))
    yield r
    r.stop()


def _ask(client: openai.OpenAI, tenant: int, question: str, salt: str | None = None, tenants=TENANTS):
    extra = {"cache_salt": salt} if salt is not None else None
    return client.chat.completions.create(
        model="default", max_tokens=1, temperature=0, extra_body=extra,
        messages=[{"role": "system", "content": tenants[tenant]}, {"role": "user", "content": question}])


def _mostly_cached(replies) -> None:
    """The tenant's system prompt (~280 of ~300 tokens) cached on the replica each request went to."""
    held = [r.usage.prompt_tokens_details.cached_tokens >= 0.8 * r.usage.prompt_tokens for r in replies]
    assert sum(held) >= 0.9 * len(replies), [(r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens)
                                             for r in replies]


def test_tenants_stick_to_the_replica_that_holds_their_prefix(router):
    client = router.client()
    for tenant in range(len(TENANTS)):                           # each tenant's first request: computed
        _ask(client, tenant, "Who are you?")
    _mostly_cached([_ask(client, tenant, f"Question {q}: what applies?") for q in range(2)
                    for tenant in range(len(TENANTS))])
    text = router.metrics()
    per_replica = [line for line in text.splitlines() if line.startswith("radixrelay_router_requests_total{")]
    assert len(per_replica) == 2 and all(float(line.rsplit(" ", 1)[1]) >= 2 for line in per_replica)
    predicted = float(next(line for line in text.splitlines()
                           if line.startswith("radixrelay_router_predicted_cached_tokens_total")).rsplit(" ", 1)[1])
    assert predicted > 0


PRECISE_TENANTS = [t.replace("rule", "law") for t in TENANTS]     # prompts neither replica has seen


def test_precise_routing_follows_the_replicas_kv_events_and_a_new_router_finds_them_in_the_store(precise, replicas, store,
                                                                                     key_file, tmp_path):
    client = precise.client()
    for tenant in range(len(TENANTS)):                           # nothing held anywhere: by load
        _ask(client, tenant, "Who are you?", tenants=PRECISE_TENANTS)
    _mostly_cached([_ask(client, tenant, f"Question {q}?", tenants=PRECISE_TENANTS) for q in range(2)
                    for tenant in range(len(TENANTS))])
    text = precise.metrics()
    assert 'radixrelay_router_requests_total{mode="precise"' in text
    assert all(f'radixrelay_router_replica_reported_load{{replica="{r.base_url}"}}' in text for r in replicas)
    assert "radixrelay_router_kv_event_lag_seconds" in text
    assert 'radixrelay_router_kv_events_rejected_total{reason="signature"} 0.0' in text     # all signed
    assert all(f'radixrelay_router_index_pages{{replica="{r.base_url}"}} 0.0' not in text for r in replicas)
    predicted = float(next(line for line in text.splitlines()
                           if line.startswith("radixrelay_router_predicted_cached_tokens_total")).rsplit(" ", 1)[1])
    assert predicted >= 0.8 * 200 * 2 * len(TENANTS)          # the later questions' held prefixes, foreseen
    # a second router started now, given no replica but the replicas' key: they announce themselves in the
    # stream, signed, which it reads from its start, so it routes as the first does
    again = RouterProcess(tmp_path, mode="precise", store=store.url, extra=("--store-key-file", key_file))
    try:
        _mostly_cached([_ask(again.client(), tenant, "After a restart?", tenants=PRECISE_TENANTS)
                        for tenant in range(len(TENANTS))])
    finally:
        again.stop()


SALTED = ["You answer salted questions. " + " ".join(f"salt{i} applies;" for i in range(12))]   # ~75 tokens


def test_salts_do_not_share_a_route_s_cache(router):
    client = router.client()
    first = _ask(client, 0, "Salted question?", salt="alpha", tenants=SALTED)
    again = _ask(client, 0, "Salted question?", salt="alpha", tenants=SALTED)
    other = _ask(client, 0, "Salted question?", salt="beta", tenants=SALTED)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].message.content == other.choices[0].message.content


def disconnects(router) -> float:
    """The router's count of clients that left before their answer was whole."""
    lines = [line for line in router.metrics().splitlines()
             if line.startswith("radixrelay_router_client_disconnects_total ")]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_a_stream_passes_through_as_the_replica_sends_it(router, replicas):
    params = dict(model="default", max_tokens=8, temperature=0, stream=True,
                  messages=[{"role": "user", "content": "Count from one to ten."}])
    direct = openai.OpenAI(base_url=f"{replicas[0].base_url}/v1", api_key="unused", max_retries=0)
    want = [c.choices[0].delta.content for c in direct.chat.completions.create(**params) if c.choices]
    before = disconnects(router)
    got = [c.choices[0].delta.content for c in router.client().chat.completions.create(**params) if c.choices]
    assert got == want and len(got) > 5
    time.sleep(0.2)
    assert disconnects(router) == before      # closed after [DONE]: the whole answer, not a client that left
    # errors come back as the replica gives them: status and OpenAI error JSON
    bad = httpx.post(f"{router.base_url}/v1/chat/completions", json={"model": "default", "messages": []})
    assert bad.status_code == 400 and "error" in bad.json()
    garbage = httpx.post(f"{router.base_url}/v1/completions", content=b"{not json")
    assert garbage.status_code == 400 and "not JSON" in garbage.json()["error"]["message"]


def test_tokenize_and_detokenize_pass_through(router, replicas):
    body = {"messages": [{"role": "user", "content": "Count from one to ten."}]}
    want = httpx.post(f"{replicas[0].base_url}/tokenize", json=body).json()
    assert httpx.post(f"{router.base_url}/tokenize", json=body).json() == want
    text = httpx.post(f"{router.base_url}/detokenize", json={"tokens": want["tokens"]}).json()["prompt"]
    assert "Count from one to ten." in text
    bad = httpx.post(f"{router.base_url}/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_a_client_that_leaves_aborts_its_request_on_the_replica(router, replicas):
    """A non-streaming request whose client gives up after a second: the router closes the upstream
    connection and the replica stops generating (no request left running there)."""
    body = {"model": "default", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a very long story."}]}
    before = disconnects(router)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{router.base_url}/v1/chat/completions", json=body, timeout=1.5)

    def running() -> float:
        lines = [line for r in replicas for line in httpx.get(f"{r.base_url}/metrics", timeout=5).text.splitlines()
                 if line.startswith("radixrelay_num_requests_running ")]
        assert len(lines) == len(replicas)
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    def counted() -> bool:
        return disconnects(router) == before + 1

    deadline = time.monotonic() + 5            # the replica's abort and the router's count land apart
    while (running() or not counted()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running() == 0
    assert counted()


def test_bad_replica_urls_and_stores_are_refused_at_start(capsys):
    """The CLI's checks, run in this process (``python -m radixrelay.cli`` exits with what ``main`` returns):
    each refusal is exit status 2 and one line saying what is wrong, before anything starts."""
    def refused(*args: str) -> str:
        capsys.readouterr()
        assert main(list(args)) == 2, args
        return capsys.readouterr().err

    for url in ("ftp://127.0.0.1:1", "127.0.0.1:30000", "http://127.0.0.1:30000/v1", "http://h:99999"):
        assert "radixrelay router: error: replica" in refused("router", "--replica", url), url
    one = ("router", "--replica", "http://127.0.0.1:1")
    assert "give --store" in refused(*one, "--mode", "precise")
    assert "redis://HOST:PORT/DB" in refused(*one, "--mode", "precise", "--store", "http://127.0.0.1:6379")
    assert "does not answer" in refused(*one, "--mode", "precise", "--store", "redis://127.0.0.1:1/0")
    assert "--kv-events: the store redis://127.0.0.1:1/0 does not answer" in refused(
        "serve", "--kv-events", "redis://127.0.0.1:1/0")


def test_a_killed_replica_leaves_the_pool_and_its_stream_ends(replicas, tmp_path):
    """Round-robin: request 1 goes to replica 0, request 2 to replica 1. Replica 1 is killed while
    streaming: that stream ends with an error (no hang), replica 1 leaves the pool within 2 s, and
    every later request is answered by replica 0."""
    router = RouterProcess(tmp_path, *(s.base_url for s in replicas), mode="round-robin")
    try:
        client = router.client()
        params = dict(model="default", max_tokens=4000, temperature=0, stream=True,
                      extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": "Tell a story."}])
        first = client.chat.completions.create(**{**params, "max_tokens": 8})    # replica 0: short
        second = client.chat.completions.create(**params)                        # replica 1: long
        next(iter(second))
        victim = replicas[1]
        for pid in [victim.proc.pid, *victim.child_pids]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        failed = False
        try:
            for chunk in second:
                pass
        except (openai.APIError, httpx.HTTPError):
            failed = True
        assert time.monotonic() - killed < 30
        deadline = killed + 2.0
        while time.monotonic() < deadline and f'replica_healthy{{replica="{victim.base_url}"}} 1.0' in router.metrics():
            time.sleep(0.1)
        assert f'radixrelay_router_replica_healthy{{replica="{victim.base_url}"}} 0.0' in router.metrics()
        later = [client.chat.completions.create(model="default", max_tokens=1, messages=[
            {"role": "user", "content": f"After the failure, question {q}?"}]) for q in range(2)]
        assert all(r.choices[0].message.content is not None for r in later)
        assert failed                                # the killed replica's stream ended with an error
        for _ in first:
            pass
    finally:
        router.stop()
