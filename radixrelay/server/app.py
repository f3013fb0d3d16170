"""The HTTP server's FastAPI app: OpenAI endpoints, health, metrics, cache control, prompt schemas.

``ServerState`` is everything one app instance shares (no module-global state). Lifecycle:
the runtime starts in the app's lifespan; ``drain`` (SIGTERM, wired by ``serve.py``) turns new
requests away with 503, lets in-flight ones finish within ``drain_timeout`` and stops the runtime;
when a runtime process dies, /health turns 503 at once, in-flight requests end with an error, and
after ``DEATH_LINGER`` seconds the server exits with code 1.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from radixrelay.config import EngineConfig, ServerConfig
from radixrelay.env import gc_mode
from radixrelay.modules.registry import SchemaRegistry
from radixrelay.model.model_registry import check_tokenizer_vocab, tokenizer_path
from radixrelay.radix.truncation import Truncation
from radixrelay.runtime.async_client import AsyncRuntimeClient
from radixrelay.proc.gc_control import FRONTEND_FULL_EVERY_S, FRONTEND_POLL_S, GcControl
from radixrelay import __version__
from radixrelay.server import openai_protocol as oa
from radixrelay.server import openapi_schema, schemas, serving, tokenize_api
from radixrelay.text.chat_template import ChatTemplate
from radixrelay.server.api_servers import (
    ApiServerArgs, Handlers, MetricsShare, SchemaChange, SchemaResult, ServerGroup, control_addresses,
)
from radixrelay.server.grammar_check import GrammarCheck
from radixrelay.protocol.stats import FrontendCounters
from radixrelay.server.prometheus_metrics import ServerMetrics
from radixrelay.text.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("radixrelay.server")
DEATH_LINGER = 2.0       # seconds /health reports 503 after a runtime death before the exit
WATCH_PEERS_S = 0.5      # server 0 checks on the other API servers this often
_encode = msgspec.json.Encoder().encode
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class ServerState:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig,
                 attach: ApiServerArgs | None = None) -> None:
        """``attach``: this process is API server ``attach.index`` >= 1 of ``config.api_servers``, sharing
        the runtime server 0 started (``radixrelay.server.api_servers``); None: server 0 (or the only one)."""
        self.engine_config = engine_config
        self.config = config
        self.attach = attach
        self.group = (ServerGroup(attach.index, config.api_servers, attach.controls) if attach is not None
                      else ServerGroup(0, config.api_servers))
        self.failure: str | None = None           # another API server died: exiting
        self.listening: Callable[[], bool] = lambda: False   # set by whoever runs the server
        self.tokenizer = load_tokenizer(tokenizer_path(engine_config))
        self.chat_template = _chat_template(self.tokenizer, config.chat_template)
        self.model_name = config.served_model_name or engine_config.model
        # Schemas of modular prompt reuse; digests name the model's weights, not its served name.
        self.schemas = SchemaRegistry.for_tokenizer(self.tokenizer, model_id=engine_config.model,
                                                    page_size=engine_config.page_size,
                                                    chat_template=config.chat_template)
        self.metrics = ServerMetrics(self.group.index)
        self.grammars = GrammarCheck(self.tokenizer)
        self.prompt_work = serving.PromptWork()   # templates and tokenization, off the event loop
        self.client: AsyncRuntimeClient | None = None
        self.collector = GcControl("frontend", "python", logger)   # replaced at start-up
        self.draining = False
        self.exit_code = 0
        self.request_exit: Callable[[], None] = lambda: None   # set by whoever runs the server
        self._background: set[asyncio.Task[None]] = set()

    @property
    def healthy(self) -> bool:
        return self.client is not None and self.client.alive and not self.draining and self.failure is None

    def serving_context(self) -> serving.ServingContext:
        assert self.client is not None
        max_choices = self.engine_config.max_running_requests + self.engine_config.max_queued_requests
        ratio = self.engine_config.truncation
        truncation = (None if ratio is None else
                      Truncation(ratio, self.client.info.max_context, self.engine_config.page_size))
        return serving.ServingContext(self.client, self.tokenizer, self.chat_template,
                                      self.model_name, self.config.max_n, self.metrics, max_choices,
                                      self.grammars, truncation, self.schemas, self.prompt_work,
                                      self.config.tool_call_parser, self.config.reasoning_parser)

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests, finish in-flight ones, stop the runtime, exit 0."""
        if not self.draining:
            self.draining = True
            self._spawn(self._drain())

    def hurry_drain(self) -> None:
        """A second signal: end the drain now (in-flight requests fail)."""
        self.begin_drain()
        self.group.signal_peers()
        if self.client is not None:
            self._spawn(self.client.shutdown(0))

    async def _drain(self) -> None:
        logger.info("draining: up to %.1f s for in-flight requests", self.config.drain_timeout)
        deadline = time.monotonic() + self.config.drain_timeout
        # the other API servers drain meanwhile, and are gone before the runtime stops
        await self.group.stop_peers(self.config.drain_timeout)
        if self.client is not None:
            await self.client.shutdown(max(0.0, deadline - time.monotonic()))
        self.request_exit()

    async def watch_peers(self) -> None:
        """Server 0: another API server that exits unless stopped is a failure of the whole server."""
        while not self.group.stopping:
            await asyncio.sleep(WATCH_PEERS_S)
            dead = self.group.dead_peer()
            if dead is not None and not self.group.stopping:
                self.failure = dead
                self._spawn(self._exit_after_death(dead, "API server"))
                return

    # -- what the API servers share (``radixrelay.server.api_servers``) ------------------------

    def control_handlers(self) -> Handlers:
        return Handlers(lambda: self.listening(), self._metrics_share, self._schema_request)

    def _metrics_share(self) -> MetricsShare:
        malformed = self.client.malformed_frames if self.client is not None else 0
        return self.metrics.share(FrontendCounters(malformed, self.collector.stats()))

    async def _schema_request(self, change: SchemaChange) -> SchemaResult:
        """A change another server sent: applied here (from server 0), or made everywhere (at server 0)."""
        if change.apply_only:
            return await self.apply_schema_change(change)
        return await self.group.change_schema(change, self.apply_schema_change)

    async def change_schema(self, change: SchemaChange) -> SchemaResult:
        """A schema change asked over HTTP: made on every API server before it is answered."""
        if not self.group.shared:
            return await self.apply_schema_change(change)
        return await self.group.change_schema(change, self.apply_schema_change)

    async def apply_schema_change(self, change: SchemaChange) -> SchemaResult:
        try:
            if change.op == "register":
                # parsing and tokenising a large schema is CPU work: off the event loop
                max_context = self.client.info.max_context if self.client is not None else None
                info: Any = await asyncio.to_thread(schemas.register, self.schemas, self.model_name, change.body,
                                                    max_context)
            else:
                info = schemas.delete(self.schemas, change.name)
        except oa.APIError as error:
            return SchemaResult(error.status, _encode(error.body()))
        return SchemaResult(200, _encode(info))

    def on_runtime_death(self, reason: str) -> None:
        self._spawn(self._exit_after_death(reason))

    async def _exit_after_death(self, reason: str, what: str = "runtime process") -> None:
        logger.error("%s died (%s); exiting in %.0f s", what, reason, DEATH_LINGER)
        self.exit_code = 1
        await asyncio.sleep(DEATH_LINGER)
        await self.group.stop_peers(0)
        if self.client is not None:
            await self.client.shutdown(0)
        self.request_exit()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _chat_template(tokenizer: Tokenizer, override: str | None) -> ChatTemplate | None:
    if override is None and tokenizer.chat_template is None:
        return None            # /v1/chat/completions answers 400 naming the model
    return ChatTemplate.for_tokenizer(tokenizer, override)


# -- helpers ----------------------------------------------------------------------------------


def _schema_response(result: SchemaResult) -> Response:
    return Response(result.body, status_code=result.status, media_type="application/json")


async def _start_api_servers(state: ServerState) -> None:
    """Server 0, its runtime ready: answer on its control socket, start the other servers, wait until they
    listen."""
    assert state.client is not None
    group, runtime = state.group, state.client.attachable()
    group.controls = control_addresses(runtime.ipc_dir, group.count)
    group.serve_control(state.control_handlers())
    await group.start_peers(state.engine_config, state.config, runtime, state.client.info,
                            logging.getLevelName(logger.getEffectiveLevel()))


def error_response(error: oa.APIError) -> Response:
    return Response(_encode(error.body()), status_code=error.status, media_type="application/json")


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(_encode(payload), status_code=status, media_type="application/json")


def check_json_content_type(request: Request) -> None:
    """Bodies are JSON: a missing Content-Type is taken as JSON (``curl -d`` habits aside, as
    FastAPI does), ``application/json`` and ``application/*+json`` pass, anything else is a 415."""
    given = request.headers.get("content-type")
    if given is None:
        return
    media = given.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise oa.APIError(415, f"Content-Type must be application/json, got {given!r}",
                      code="unsupported_media_type")


async def read_body(request: Request, cap: int) -> bytes:
    too_big = oa.APIError(413, f"request body exceeds {cap} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                raise too_big
    except ClientDisconnect:      # the client left mid-body (or its read deadline closed it): not a 500
        raise ClientGone from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)      # one copy of the body


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first (then cancel it: ClientGone)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()           # takes effect at the task's next await: it is not done yet
    if task not in done or task.cancelled():
        raise ClientGone
    return task.result()


class GateMiddleware:
    """Before any route: 503 while draining or after a runtime death (except /health and
    /metrics, which report it), then the API key on /v1/*, /flush_cache, /tokenize and /detokenize."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> oa.APIError | None:
        path = scope["path"]
        if path in ("/health", "/metrics"):
            return None
        if not self.state.healthy:
            why = "the server is shutting down" if self.state.draining else "the runtime is not available"
            return oa.APIError(503, why, type="server_error", code="unavailable")
        key = self.state.config.api_key
        if key is not None and (path.startswith("/v1/") or path in openapi_schema.KEYED_PATHS):
            given = Headers(scope=scope).get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), key.encode()):
                return oa.APIError(401, "invalid or missing API key", type="authentication_error",
                                   code="invalid_api_key")
        return None


# -- the app ----------------------------------------------------------------------------------


async def _collect_when_due(state: ServerState) -> None:
    """The frontend's garbage-collection timer (``GcControl.poll``): idle while no request streams."""
    while True:
        await asyncio.sleep(FRONTEND_POLL_S)
        client = state.client
        state.collector.poll(idle=client is None or client.num_live == 0)


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        group = state.group
        if state.attach is not None:           # API server 1..N-1: the runtime is server 0's
            state.client = AsyncRuntimeClient.attach(state.attach.runtime, state.attach.info, group.index)
            group.serve_control(state.control_handlers())
        else:
            state.client = await AsyncRuntimeClient.start(state.engine_config, group.count)
            try:
                check_tokenizer_vocab(state.engine_config, state.tokenizer.vocab_size,
                                      state.client.info.vocab_size)
                if group.shared:
                    await _start_api_servers(state)
            except BaseException:
                group.kill_peers()
                group.close()
                await state.client.shutdown(0)
                raise
            logger.info("runtime ready: %d KV tokens, context %d", state.client.info.kv_cache_tokens,
                        state.client.info.max_context)
        state.client.on_death.append(state.on_runtime_death)
        watcher = asyncio.create_task(state.watch_peers()) if group.peers else None
        # The tokenizer, templates and app: frozen out of the garbage collector; full collections when
        # no request is streaming, or once a minute under load (gc_control).
        state.collector = GcControl("frontend", gc_mode(), logger, full_every_s=FRONTEND_FULL_EVERY_S)
        state.collector.settle()
        ticker = asyncio.create_task(_collect_when_due(state))
        try:
            yield
        finally:
            ticker.cancel()
            if watcher is not None:
                watcher.cancel()
            state.collector.uninstall()
            await group.stop_peers(0)          # already gone after a drain
            group.close()
            await state.client.shutdown(0)

    app = FastAPI(title="radixrelay", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.add_middleware(GateMiddleware, state=state)

    # Routing errors (404 unknown path, 405 wrong method) and anything unexpected answer with
    # OpenAI's error JSON too, never FastAPI's {"detail": ...} or a plain-text 500.
    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        response = error_response(oa.APIError(exc.status_code, str(exc.detail), code=code))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> Response:
        logger.error("unhandled error", exc_info=exc)
        return error_response(oa.APIError(500, f"{type(exc).__name__}: {exc}", type="server_error"))

    def openapi() -> dict[str, Any]:
        """Built on first use: the limits it publishes come from the running runtime."""
        if app.openapi_schema is None:
            info = state.client.info if state.client is not None else None
            limits = openapi_schema.Limits(
                model_name=state.model_name, max_n=state.config.max_n,
                max_context=info.max_context if info else 1, vocab_size=info.vocab_size if info else 1,
                api_key=state.config.api_key is not None, priority=state.engine_config.enable_priority)
            app.openapi_schema = openapi_schema.build(app.routes, app.version, limits)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    cap = state.config.max_body_bytes

    async def generate(request: Request, kind: type[oa.ChatCompletionRequest] | type[oa.CompletionRequest]) -> Response:
        arrived = time.monotonic()
        state.metrics.api_requests.inc()
        ctx = state.serving_context()
        stages: serving.Stages = {}
        try:
            check_json_content_type(request)
            try:
                with serving.timed(stages, "parse"):
                    req = oa.decode_request(await read_body(request, cap), kind)
                if isinstance(req, oa.ChatCompletionRequest):
                    choices = await until_disconnect(request, serving.chat_choices(ctx, req, stages))
                else:
                    choices = await until_disconnect(request, serving.completion_choices(ctx, req, stages))
            finally:
                state.metrics.observe_stages(stages)
            await until_disconnect(request, serving.check_structured(ctx, req, choices))
            job = serving.GenerationJob(ctx, choices, req.cache_salt, arrived)
            if req.stream:
                first = await until_disconnect(request, serving.start_stream(job))
                if isinstance(req, oa.ChatCompletionRequest):
                    body = serving.chat_stream(ctx, job, first, req.include_usage)
                else:
                    body = serving.completion_stream(ctx, job, first, req.include_usage)
                return serving.stream_response(body, job)
            await until_disconnect(request, serving.run_to_end(job))
            if isinstance(req, oa.ChatCompletionRequest):
                return json_response(serving.chat_response(ctx, job))
            return json_response(serving.completion_response(ctx, job))
        except ClientGone:
            return Response(status_code=499)      # nobody is listening; the request was aborted
        except Exception as exc:  # noqa: BLE001 - every failure becomes OpenAI's error JSON
            error = serving.api_error(exc)
            # A runtime death is logged by the runtime client: one line per request, no traceback.
            if error.status >= 500 and error.code != "runtime_unavailable":
                logger.exception("request failed")
            return error_response(error)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, oa.ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, oa.CompletionRequest)

    # Prompt schemas (modular prompt reuse). Not in /openapi.json: see ``schemas``.
    @app.post("/v1/schemas", include_in_schema=False)
    async def create_schema(request: Request) -> Response:
        try:
            check_json_content_type(request)
            body = await read_body(request, cap)
            return _schema_response(await state.change_schema(SchemaChange("register", body=body)))
        except oa.APIError as error:
            return error_response(error)
        except ClientGone:
            return Response(status_code=499)

    @app.get("/v1/schemas", include_in_schema=False)
    async def list_schemas() -> Response:
        return json_response(schemas.listing(state.schemas))

    @app.get("/v1/schemas/{name}", include_in_schema=False)
    async def get_schema(name: str) -> Response:
        try:
            return json_response(schemas.get(state.schemas, name))
        except oa.APIError as error:
            return error_response(error)

    @app.delete("/v1/schemas/{name}", include_in_schema=False)
    async def delete_schema(name: str) -> Response:
        return _schema_response(await state.change_schema(SchemaChange("delete", name=name)))

    @app.get("/v1/models")
    async def models() -> Response:
        info = state.client.info if state.client is not None else None
        card = oa.ModelCard(state.model_name, int(time.time()), info.max_context if info else 0)
        return json_response(oa.ModelList([card]))

    @app.get("/health")
    async def health() -> Response:
        if state.healthy:
            return json_response(oa.Health("ok"))
        return json_response(oa.Health("draining" if state.draining else "unavailable"), 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = None
        if state.client is not None and state.client.alive and not state.draining:
            stats = await state.client.stats()
            frontend = state.metrics.frontend(msgspec.structs.replace(stats.frontend, gc=state.collector.stats()))
            stats = msgspec.structs.replace(stats, frontend=frontend)
        peers = await state.group.pull_metrics() if state.group.shared else []
        info = state.client.info if state.client is not None else None
        return Response(state.metrics.render(stats, info.precision if info is not None else None, peers),
                        media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _token_endpoint(request, tokenize_api.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _token_endpoint(request, tokenize_api.detokenize)

    async def _token_endpoint(request: Request, work: Callable[[serving.ServingContext, bytes], Any]) -> Response:
        """``/tokenize`` and ``/detokenize`` (``tokenize_api``): the body read within the cap, the work
        in the prompt pool when the body is large."""
        try:
            check_json_content_type(request)
            body = await read_body(request, cap)
            ctx = state.serving_context()
            return json_response(await ctx.run_prompt_work(len(body), partial(work, ctx, body)))
        except oa.APIError as error:
            return error_response(error)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        assert state.client is not None
        if await state.client.flush_cache():
            return json_response(oa.Flushed(True))
        return error_response(oa.APIError(409, "cache not flushed: requests are running",
                                          code="requests_running"))

    return app
