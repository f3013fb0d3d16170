"""Test helper: a stand-in replica for the router's tests, a real HTTP server (aiohttp, on its own event loop
in a thread of the test process) in place of a model server. ``/health`` is 200; ``/v1/models`` lists one
model; the two POST endpoints behave as the request's ``model`` asks:

- ``echo``: 200 with the request headers it saw (``authorization``, ``content-type``, ``accept``) and the
  body's length in bytes, as JSON;
- ``huge`` / ``huge-chunked``: 200 with ``size`` bytes (with a Content-Length / chunked, in 64 KiB writes);
- ``hang``: never answers; ``hang-stream``: one SSE event, then silence;
- ``redirect``: 307 to ``/landing`` on itself (which would record a ``landing`` request);
- ``die-stream``: one SSE event and half of another, then the connection is cut;
- ``slow-stream``: an SSE event every 50 ms for 30 s.

With ``api_key``, every ``/v1/`` path needs ``Authorization: Bearer KEY`` (a 401 in OpenAI's error JSON
otherwise), as ``radixrelay serve --api-key`` does. ``seen`` lists ``(path, model)`` per POST;
``closed`` lists the models of answers whose connection the router closed before they were complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

from aiohttp import web

CHUNK = 64 * 1024


def _event(n: int) -> bytes:
    chunk = {"id": "c1", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": f" t{n}", "finish_reason": None, "logprobs": None}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


class StandIn:
    def __init__(self, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.seen: list[tuple[str, str]] = []
        self.closed: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("stand-in replica did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(middlewares=[self._key_check], client_max_size=1 << 30)
        app.router.add_get("/health", _health)
        app.router.add_get("/v1/models", _models)
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/landing", self._answer)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        started.set()
        self._loop.run_forever()

    def stop(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @web.middleware
    async def _key_check(self, request: web.Request, handler):
        if self.api_key is not None and request.path.startswith("/v1/") and \
                request.headers.get("authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "invalid or missing API key", "type":
                                                 "authentication_error", "param": None, "code": "invalid_api_key"}},
                                     status=401)
        return await handler(request)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        model = body.get("model", "echo")
        self.seen.append((request.path, model))
        if request.path == "/landing":
            return web.json_response({"landed": True})
        if model == "echo":
            return web.json_response({"headers": {k: request.headers.get(k) for k in
                                                  ("authorization", "content-type", "accept")},
                                      "bytes": len(raw)})
        if model == "redirect":
            raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{self.port}/landing")
        if model == "hang":
            while not _gone(request):
                await asyncio.sleep(0.05)
            self.closed.append(model)
            return web.Response()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        if model in ("huge", "huge-chunked"):
            response.content_type = "application/json"
            if model == "huge":
                response.content_length = body["size"]
        await response.prepare(request)
        try:
            if model in ("huge", "huge-chunked"):
                left = body["size"]
                while left > 0:
                    await response.write(b"x" * min(CHUNK, left))
                    left -= CHUNK
            elif model == "hang-stream":
                await response.write(_event(0))
                while not _gone(request):
                    await asyncio.sleep(0.05)
                raise ConnectionResetError
            elif model == "die-stream":
                await response.write(_event(0) + _event(1)[:20])
                await asyncio.sleep(0.1)
                request.transport.abort()
                return response
            elif model == "slow-stream":
                for n in range(600):
                    await response.write(_event(n))
                    await asyncio.sleep(0.05)
                    if _gone(request):
                        raise ConnectionResetError
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.closed.append(model)
            raise
        return response


async def _health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                          "owned_by": "radixrelay"}]})


def _gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()
