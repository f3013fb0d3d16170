"""The router's HTTP front: OpenAI's chat and completions endpoints, each request proxied whole to one
replica (``policy.choose``), its answer passed back unchanged (status, body; a stream byte for byte, as
it arrives). A client that disconnects (from a stream, or while waiting for a whole answer) closes the
upstream connection, which aborts the request on the replica. A replica that fails to answer gets the client an OpenAI error (502) and leaves
the pool; one that dies mid-stream ends the stream with an error event and ``data: [DONE]``. The limits as a
proxy (body and answer sizes, upstream timeouts, no redirects, the in-flight cap) and the router's own error
answers are ``radixrelay.router.proxy``'s; the exchanges with the replicas ``radixrelay.router.upstream``'s.

``GET /health`` is 200 while a replica is in the pool; ``GET /metrics`` has the router's counters;
``GET /v1/models`` is a healthy replica's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import ClientDisconnect

from radixrelay.net.connections import ConnectionLimits, uvicorn_options
from radixrelay.router.index import PrefixIndex
from radixrelay.router.routing import MODES, CacheKeyAffinity, Candidate, choose, tier_tokens
from radixrelay.router.kv_index import KVEventIndex
from radixrelay.router.prompt import PAGE_TOKENS, InvalidPrompt, Prompt, PromptKeys
from radixrelay.router import upstream
from radixrelay.router.proxy import (
    OFFLOAD_BYTES, ProxyError, ProxyLimits, ProxyState, install_error_handlers, invalid, parse_object, read_body,
    upstream_error,
)
from radixrelay.router.replicas import Pool, Replica
from radixrelay.router.upstream import (
    UPSTREAM_ERRORS, ClientGone, RelayedStream, forwarded_headers, open_session, until_client_leaves,
)

logger = logging.getLogger("radixrelay.router")
# Endpoints whose requests leave KV on the replica (keyed, scored and recorded); the others (/tokenize,
# /detokenize) are proxied to the least loaded replica.
GENERATION = ("chat", "completions")

@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[str, ...]
    mode: str = "approximate"
    index_capacity: int = 1 << 20          # page keys remembered per replica
    store: str | None = None               # redis://... of the replicas' KV events (precise mode)
    # The limits as a proxy (``radixrelay.router.proxy``: body and answer sizes, upstream timeouts, the
    # in-flight cap), checked when they are made.
    limits: ProxyLimits = ProxyLimits()
    # The trust boundary over the store (``radixrelay.router.trust``, docs/router.md): names of announced
    # replicas that may join the pool (a regular expression, full match), the key every entry must be
    # signed with (its file; signed announcements may join), the store's password (its file).
    replica_pattern: str | None = None
    store_key_file: str | None = None
    store_password_file: str | None = None

    def __post_init__(self) -> None:
        discovers = self.replica_pattern is not None or self.store_key_file is not None
        if not self.replicas and not (self.mode == "precise" and self.store is not None and discovers):
            raise ValueError("the router needs at least one --replica (or --mode precise with --store and "
                             "--replica-pattern or --store-key-file: replicas started with --kv-events whose "
                             "names match, or whose events are signed with the key, announce themselves)")
        if self.store is None and (discovers or self.store_password_file is not None):
            raise ValueError("--replica-pattern, --store-key-file and --store-password-file are about the KV "
                             "events' store: give --store redis://HOST:PORT/DB (with --mode precise)")
        from radixrelay.router.trust import compile_pattern

        compile_pattern(self.replica_pattern)
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError("a replica is given twice")
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "precise" and self.store is None:
            raise ValueError("--mode precise reads the replicas' KV events: give --store redis://HOST:PORT/DB")
        if self.store is not None:
            from radixrelay.kv_events import check_store_url

            check_store_url(self.store)


class Router:
    def __init__(self, config: RouterConfig, prompt_keys: PromptKeys, events: KVEventIndex | None = None) -> None:
        self.config = config
        self.prompt_keys = prompt_keys
        self.events = events                   # the replicas' KV events (precise mode)
        self.index = PrefixIndex(config.index_capacity)
        self.affinity = CacheKeyAffinity()     # prompt_cache_key -> replica (``policy``)
        discover = events.replica_names if events is not None and config.mode == "precise" else None
        self.pool = Pool([Replica(url) for url in config.replicas], on_leave=self._left, discover=discover)
        self.client: httpx.AsyncClient | None = None          # health polls
        self.session: aiohttp.ClientSession | None = None     # the proxied requests, /v1/models
        self._turn = 0
        self.registry = CollectorRegistry()
        self.decisions = Counter("radixrelay_router_requests", "Requests routed, by mode and replica.",
                                 ["mode", "replica"], registry=self.registry)
        self.predicted = Counter("radixrelay_router_predicted_cached_tokens",
                                 "Prompt tokens the router expected the chosen replica to hold (its index).",
                                 registry=self.registry)
        self.reported = Counter("radixrelay_router_reported_cached_tokens",
                                "Cached prompt tokens the replicas reported in usage (non-streaming answers).",
                                registry=self.registry)
        self.client_gone = Counter("radixrelay_router_client_disconnects",
                                   "Requests whose client disconnected before the answer; the upstream "
                                   "request was closed, which aborts it on the replica.", registry=self.registry)
        self.retried = Counter("radixrelay_router_upstream_retries",
                               "Requests sent again on a new connection after the replica closed a kept-alive "
                               "one before answering.", ["replica"], registry=self.registry)
        self.upstream_errors = Counter("radixrelay_router_upstream_errors",
                                       "Requests a replica failed to answer (connection refused, reset, "
                                       "closed mid-stream).", ["replica"], registry=self.registry)
        # precise mode with a stalled KV-event reader: routed approximately (this router's own index) meanwhile
        self.fallbacks = Counter("radixrelay_router_precise_fallbacks",
                                 "Requests routed approximately (this router's own index) because the KV-event "
                                 "reader was stalled.", registry=self.registry)
        self._precise_failed = False
        self.registry.register(_PoolCollector(self))
        self.proxy = ProxyState(self.registry)                # the in-flight cap, the router's own errors

    # -- routing ---------------------------------------------------------------------------------

    def _left(self, replica: Replica) -> None:
        self.index.drop(replica.url)
        self.affinity.drop(replica.url)

    def pick(self, keys: list[bytes], prompt: Prompt | None = None,
             cache_key: tuple[str | None, str] | None = None) -> tuple[Replica, int] | None:
        """(replica, the prompt tokens it is expected to hold), or None when no replica is healthy.
        ``keys``: the router's own page keys of the prompt (approximate); ``prompt``: its tokens and salt
        (precise: looked up under each replica's own page keys). Precise mode routes approximately while
        its KV-event reader is stalled, rather than failing requests. ``cache_key``: (salt,
        prompt_cache_key): the replica the key's last request went to, while it is healthy."""
        healthy = self.pool.healthy()
        if not healthy:
            return None
        if cache_key is not None:
            url = self.affinity.get(cache_key)
            sticky = next((r for r in healthy if r.url == url), None)
            if sticky is None:
                picked = self._pick(healthy, keys, prompt)
                self.affinity.set(cache_key, picked[0].url)
                return picked
            self._turn += 1
            return sticky, self.index.matched(sticky.url, keys) * PAGE_TOKENS if keys else 0
        return self._pick(healthy, keys, prompt)

    def _pick(self, healthy: list[Replica], keys: list[bytes], prompt: Prompt | None) -> tuple[Replica, int]:
        mode = self.config.mode
        measured = self._precise(healthy, prompt) if mode == "precise" and self.events is not None else None
        if measured is not None:
            held, load = measured
        else:
            if mode == "precise":
                mode = "approximate"
                self.fallbacks.inc()
                if prompt is not None and not keys:
                    keys = self.prompt_keys.keys_of(prompt)
            held = [self.index.matched(r.url, keys) * PAGE_TOKENS for r in healthy]
            load = [r.in_flight for r in healthy]
        candidates = [Candidate(r.url, n, q) for r, n, q in zip(healthy, held, load, strict=True)]
        chosen = choose(mode, candidates, self._turn)
        self._turn += 1
        replica = next(r for r in healthy if r.url == chosen.replica)
        if mode != self.config.mode and keys:
            self.index.record(replica.url, keys)      # the fallback's own index (route records in approximate mode)
        return replica, chosen.matched_tokens

    def _precise(self, healthy: list[Replica], prompt: Prompt | None) -> tuple[list[int], list[int]] | None:
        """(matched tokens, load) per replica by their KV events; None while the reader is stalled."""
        events = self.events
        if events.stalled():
            return None
        try:
            urls = [r.url for r in healthy]
            held = ([tier_tokens(*tiers, events.reported_rates(url))
                     for url, tiers in zip(urls, events.matched_tiers_many(urls, prompt.token_ids, prompt.salt))]
                    if prompt else [0] * len(healthy))
            # load: this router's requests in flight there, or what the replica last reported running and
            # waiting (other routers' requests included), whichever is larger
            load = [max(r.in_flight, events.reported_load(r.url)) for r in healthy]
        except Exception:  # noqa: BLE001 - a fault in the index must not fail requests: approximate instead
            if not self._precise_failed:
                self._precise_failed = True
                logger.exception("precise routing failed; routing approximately (logged once)")
            return None
        return held, load

    async def route(self, request: Request, endpoint: str, path: str) -> Response:
        """The replica's answer to ``request``, or the router's own error answer (``proxy``): never an
        exception. One this code did not foresee is a 500 in OpenAI's error JSON, logged (rate-limited).
        Past ``max_in_flight`` requests in the router: a 429, no replica asked."""
        proxy = self.proxy
        if proxy.active >= self.config.limits.max_in_flight:
            return proxy.answer(ProxyError(429, f"the router has {proxy.active} requests in flight (--max-in-flight)"
                                           "; retry later", "rate_limit_error", "rate_limit_exceeded"))
        proxy.active += 1
        relayed = False
        try:
            response = await self._route(request, endpoint, path)
            relayed = isinstance(response, RelayedStream)          # released when the stream is over
            return response
        except ProxyError as exc:
            return proxy.answer(exc)
        except Exception as exc:
            return proxy.unexpected(exc, path)
        finally:
            if not relayed:
                proxy.active -= 1

    async def _route(self, request: Request, endpoint: str, path: str) -> Response:
        limits = self.config.limits
        try:
            raw = await read_body(request, limits.max_body_bytes)
        except ClientDisconnect:                 # the client left before its body was whole: nothing to answer
            self.client_gone.inc()
            return Response(status_code=499)
        # parsing and tokenizing a large body takes milliseconds: in a thread, so that other requests and
        # /health are answered meanwhile
        body, prompt = await asyncio.to_thread(self._parse, endpoint, raw) if len(raw) > OFFLOAD_BYTES else \
            self._parse(endpoint, raw)
        keys = self.prompt_keys.keys_of(prompt) if prompt is not None and self.config.mode != "precise" else []
        key, salt = body.get("prompt_cache_key"), body.get("cache_salt")
        sticky = (salt if isinstance(salt, str) else None, key) if isinstance(key, str) else None
        picked = self.pick(keys, prompt, sticky)
        if picked is None:
            raise ProxyError(503, "no replica is available", "service_unavailable")
        replica, expected = picked
        self.decisions.labels(self.config.mode, replica.url).inc()
        self.predicted.inc(expected)
        replica.requests += 1
        replica.in_flight += 1
        relayed = False
        try:
            try:
                resp, content = await until_client_leaves(request, upstream.post(
                    self.session, replica.url, f"{replica.url}{path}", raw, forwarded_headers(request),
                    stream=body.get("stream") is True, cap=limits.max_response_bytes,
                    on_retry=self.retried.labels(replica.url).inc))
            except ClientGone:
                self.client_gone.inc()
                return Response(status_code=499)
            except ProxyError:                   # the replica's answer refused: a redirect, too large
                self.upstream_errors.labels(replica.url).inc()
                raise
            except UPSTREAM_ERRORS as exc:
                raise self._upstream_failure(replica, exc) from None
            if resp.status == 200 and keys:
                self.index.record(replica.url, keys)
            if content is None:                  # a stream: relayed as it arrives
                relayed = True
                return self._relay(replica, resp)
            if resp.status == 200:
                self.reported.inc(_cached_tokens(content))
            return Response(content, status_code=resp.status, media_type=resp.headers.get("content-type"))
        finally:
            if not relayed:
                replica.in_flight -= 1

    def _parse(self, endpoint: str, raw: bytes) -> tuple[dict, Prompt | None]:
        """The body and its prompt (``PromptKeys.prompt``); ``ProxyError`` (400) for a body the router
        cannot use."""
        body = parse_object(raw)
        if endpoint not in GENERATION:           # no KV stays behind: routed by load alone, nothing recorded
            return body, None
        try:
            return body, self.prompt_keys.prompt(endpoint, body)
        except InvalidPrompt as exc:
            raise invalid(str(exc), "prompt") from None
        except RecursionError:                   # chat messages nested about as deeply as the parser takes
            raise invalid("the body is nested too deeply") from None

    def _relay(self, replica: Replica, resp: aiohttp.ClientResponse) -> RelayedStream:
        """The replica's stream to the client (``upstream.relay``); once it is over, the replica's and the
        router's in-flight counts drop, and a client that left before its end is counted."""
        def release(ended: bool) -> None:
            replica.in_flight -= 1
            self.proxy.active -= 1
            if not ended:
                self.client_gone.inc()

        return upstream.relay(resp, lambda exc: self._upstream_failure(replica, exc, mid_stream=True), release)

    def _upstream_failure(self, replica: Replica, exc: BaseException, mid_stream: bool = False) -> ProxyError:
        """``exc``, raised while proxying to ``replica``, as the client's error; counted. The replica leaves the
        pool unless it was only silent for ``upstream_read_timeout`` (busy is not down: its health polls
        decide)."""
        self.upstream_errors.labels(replica.url).inc()
        limits, name = self.config.limits, type(exc).__name__
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            self.pool.mark_down(replica, f"no connection within {limits.upstream_connect_timeout:g} s")
            return upstream_error(504, f"replica {replica.url} did not accept a connection within "
                                  f"{limits.upstream_connect_timeout:g} s; retry the request", "upstream_timeout")
        if isinstance(exc, asyncio.TimeoutError):
            return upstream_error(504, f"replica {replica.url} sent nothing for {limits.upstream_read_timeout:g} s "
                                  "(--upstream-read-timeout)", "upstream_timeout")
        self.pool.mark_down(replica, f"{name} {'mid-stream' if mid_stream else 'while proxying'}")
        what = "failed mid-stream" if mid_stream else "did not answer"
        return upstream_error(502, f"replica {replica.url} {what} ({name}); retry the request", "upstream_error")

    async def models(self, request: Request) -> Response:
        """A healthy replica's ``/v1/models``, asked with the client's headers (``upstream.get_models``)."""
        answer = await upstream.get_models(self.session, [r.url for r in self.pool.healthy()],
                                           forwarded_headers(request), self.config.limits.max_response_bytes)
        if answer is None:
            raise ProxyError(503, "no replica is available", "service_unavailable")
        return answer


def _cached_tokens(content: bytes) -> int:
    try:
        usage = json.loads(content).get("usage") or {}
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


class _PoolCollector:
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        healthy = GaugeMetricFamily("radixrelay_router_replica_healthy", "1 while the replica is in the pool.",
                                    labels=["replica"])
        in_flight = GaugeMetricFamily("radixrelay_router_replica_in_flight",
                                      "This router's requests sent to the replica and not yet answered.",
                                      labels=["replica"])
        indexed = GaugeMetricFamily("radixrelay_router_index_pages",
                                    "Page keys the router's index holds for the replica (precise: from its KV "
                                    "events; approximate: what this router sent it).", labels=["replica"])
        events = self.router.events
        for r in self.router.pool.replicas:
            healthy.add_metric([r.url], int(r.healthy))
            in_flight.add_metric([r.url], r.in_flight)
            indexed.add_metric([r.url], events.holds(r.url) if events is not None else self.router.index.size(r.url))
        yield from (healthy, in_flight, indexed)
        if events is not None:
            reported = GaugeMetricFamily("radixrelay_router_replica_reported_load",
                                         "Requests the replica last reported running and waiting (its KV events).",
                                         labels=["replica"])
            for r in self.router.pool.replicas:
                reported.add_metric([r.url], events.reported_load(r.url))
            yield reported
            yield GaugeMetricFamily("radixrelay_router_kv_events_read", "KV events read from the store.",
                                    value=events.events)
            yield GaugeMetricFamily("radixrelay_router_kv_event_lag_seconds",
                                    "Age of the latest KV event when this router read it.", value=events.lag_s)
            yield from _reader_metrics(events)


def _reader_metrics(events: KVEventIndex):
    """The KV-event reader's health: stalled or not, seconds since its last read, restarts, entries refused."""
    status = events.status()
    yield GaugeMetricFamily("radixrelay_router_kv_events_reader_stalled",
                            "1 while the KV-event reader has not read from the store for its stall time "
                            "(precise mode routes approximately meanwhile).", value=int(status.reader == "stalled"))
    if status.seconds_since_read is not None:
        yield GaugeMetricFamily("radixrelay_router_kv_events_seconds_since_read",
                                "Seconds since the KV-event reader's last successful read.",
                                value=status.seconds_since_read)
    yield CounterMetricFamily("radixrelay_router_kv_events_reader_restarts",
                              "KV-event reader loops started again after a failure.", value=status.restarts)
    rejected = CounterMetricFamily("radixrelay_router_kv_events_rejected",
                                   "KV-event entries skipped, by reason (malformed, unsigned, unknown replica, "
                                   "replayed, ...).", labels=["reason"])
    for reason, n in sorted(dict(events.rejected).items()):
        rejected.add_metric([reason], n)
    yield rejected


def build_app(router: Router):
    """The router's ASGI app: the two proxied endpoints straight to ``Router.route`` (each request's share of
    the router's cost: FastAPI's middleware and routing layers are not needed there), the rest (health,
    metrics, models, lifespan) through FastAPI."""
    app = _fastapi_app(router)
    proxied = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

    async def asgi(scope, receive, send) -> None:
        endpoint = proxied.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await app(scope, receive, send)
            return
        response = await router.route(Request(scope, receive), endpoint, scope["path"])
        await response(scope, receive, send)

    return asgi


def _fastapi_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        # the proxied requests: aiohttp's client (httpx's pure-Python path was most of the router's cost)
        session = open_session(router.config.limits)
        # httpx logs every request at INFO: one line per health poll, twice a second per replica. The
        # pool logs what matters (a replica joining or leaving).
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger("httpx").level))
        async with session, httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits) as client:
            router.client, router.session = client, session
            if router.events is not None:
                await asyncio.to_thread(router.events.start)     # what the stream holds so far, then a reader
            await router.pool.poll_once(client)          # the pool as of start-up
            if not router.pool.healthy():
                logger.warning("no replica answers /health yet: requests get 503 until one does")
            task = asyncio.create_task(router.pool.run(client))
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                if router.events is not None:
                    router.events.close()

    app = FastAPI(title="radixrelay router", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app, router.proxy)          # OpenAI's error JSON for every failure, 404 and 405 too

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.route(request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route(request, "completions", "/v1/completions")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await router.route(request, "tokenize", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await router.route(request, "detokenize", "/detokenize")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> Response:
        # 200 while a replica is in the pool, whatever the KV-event reader's state (a stalled one: routing
        # goes on, approximately); "kv_events" says how the reader is doing
        n = len(router.pool.healthy())
        body: dict = {"replicas_in_pool": n}
        if router.events is not None:
            body["kv_events"] = router.events.status().as_json()
        return Response(json.dumps(body), status_code=200 if n else 503, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4")

    return app


def run_router(config: RouterConfig, prompt_keys: PromptKeys, host: str, port: int, log_level: str,
               events: KVEventIndex | None = None, connections: ConnectionLimits | None = None) -> int:
    """Serve until stopped; the exit code. ``connections``: the client connections' limits (a read deadline
    and a cap, ``radixrelay.net.connections``; the defaults when None), resolved here if not yet."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    from radixrelay.net.log_limits import limit_logs

    limits = connections or ConnectionLimits(fds_per_connection=2)
    if limits.max_connections is None:
        limits = limits.resolved()
    app = build_app(Router(config, prompt_keys, events))
    logger.info("routing to %s (%s)", ", ".join(config.replicas), config.mode)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                           **uvicorn_options(limits)))
    limit_logs()                   # after uvicorn.Config, which configures uvicorn's loggers
    logger.info("connections: at most %d open, %g s to read each request", limits.max_connections,
                limits.read_timeout_s)
    try:
        server.run()
    except KeyboardInterrupt:      # uvicorn re-raises the SIGINT it handled once it has shut down
        pass
    return 0 if server.started else STARTUP_FAILURE

