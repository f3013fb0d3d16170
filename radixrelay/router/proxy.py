"""The router's limits as a proxy, and the answers it gives itself instead of a replica's.

- A request body over ``max_body_bytes`` (the server's own default and flag) is a 413, decided from its
  Content-Length when it has one, else as soon as what was read passes the cap: the router never holds more
  than the cap of one body. A body the router cannot use (not JSON, nested too deeply, not an object,
  prompt token ids out of range) is a 400; bodies over ``OFFLOAD_BYTES`` are parsed in a thread.
- A whole answer over ``max_response_bytes`` is a 502 and its upstream connection is closed; a stream is
  relayed chunk by chunk as it arrives (each chunk bounded by the client library's read buffer), so it has
  no total. A redirect from a replica is a 502, never followed.
- ``upstream_connect_timeout`` bounds connecting to a replica and ``upstream_read_timeout`` the longest
  silence between bytes from it (504; in a stream, an error event then ``data: [DONE]``).
- Past ``max_in_flight`` requests in the router, a 429 without contacting a replica.

Every such answer is OpenAI's error JSON (``error_response``) and is counted by HTTP status.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from radixrelay.config import ServerConfig
from radixrelay.net.log_limits import RateLimitFilter
from radixrelay.text.json_ids import plain_ids

# Bodies larger than this are parsed, and their prompts tokenized, in a thread rather than on the event loop.
OFFLOAD_BYTES = 64 * 1024
# The size of the reads of a whole answer from a replica.
READ_CHUNK = 64 * 1024

# The router's own failures (a bug that every request hits, say): one line per cause a minute at most.
logger = logging.getLogger("radixrelay.router.proxy")
logger.addFilter(RateLimitFilter(60.0))


@dataclass(frozen=True)
class ProxyLimits:
    max_body_bytes: int = ServerConfig.max_body_bytes     # the server's default: 4 MiB
    max_response_bytes: int = 64 * 1024 * 1024          # a whole answer from a replica
    upstream_connect_timeout: float = 5.0               # seconds to connect to a replica
    upstream_read_timeout: float = 600.0                # seconds of silence from a replica, at most
    max_in_flight: int = 4096                           # requests in the router at once; more get 429

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_response_bytes < 1024:
            raise ValueError(f"--max-response-bytes must be >= 1024, got {self.max_response_bytes}")
        for flag, value in (("--upstream-connect-timeout", self.upstream_connect_timeout),
                            ("--upstream-read-timeout", self.upstream_read_timeout)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} must be a number of seconds > 0, got {value}")
        if self.max_in_flight < 1:
            raise ValueError(f"--max-in-flight must be >= 1, got {self.max_in_flight}")


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(error_body(message, type_, code, param)), status_code=status,
                    media_type="application/json", headers=headers)


class ProxyError(Exception):
    """An answer the router gives itself (OpenAI's error JSON) instead of a replica's."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)

    def response(self) -> Response:
        return error_response(self.status, self.message, self.type, self.code, self.param)

    def sse(self) -> bytes:
        """The error as a stream's last event, then the stream's end."""
        return f"data: {json.dumps(self.body())}\n\ndata: [DONE]\n\n".encode()


def invalid(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param)


def upstream_error(status: int, message: str, code: str) -> ProxyError:
    return ProxyError(status, message, "upstream_error", code)


async def read_body(request: Request, cap: int) -> bytes:
    """The request's body, at most ``cap`` bytes: a 413 from its Content-Length alone when that says more,
    else as soon as what was read passes ``cap`` (the rest is never read)."""
    too_big = ProxyError(413, f"request body exceeds {cap} bytes (--max-body-bytes)", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > cap:
            raise too_big
    return bytes(body)


_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_FLAT_IDS = re.compile(rb"\[\s*[0-9]")


def parse_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; ``ProxyError`` (400) when it is not JSON, is nested past what the parser
    takes (Python's recursion limit), or is not an object. A flat array of token ids as ``prompt`` is an
    int64 numpy array (``radixrelay.text.json_ids``: parsed in C, shared with recent prompts by prefix),
    every other value what ``json.loads`` gives."""
    fast = _parse_fields(raw)
    if fast is not None:
        return fast
    try:
        body = json.loads(raw)
    except RecursionError:
        raise invalid("the body is nested too deeply") from None
    except ValueError as exc:               # malformed, not UTF-8, an integer of over 4300 digits
        raise invalid(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


def _parse_fields(raw: bytes) -> dict[str, Any] | None:
    """The object's fields decoded by msgspec; None for anything msgspec refuses and ``json.loads`` may
    still take or refuse with its own message (not an object, NaN, integers past 64 bits, deep nesting)."""
    try:
        fields = _FIELDS.decode(raw)
        body: dict[str, Any] = {}
        for name, value in fields.items():
            ids = plain_ids(value) if name == "prompt" and _FLAT_IDS.match(memoryview(value)) else None
            body[name] = ids if ids is not None else msgspec.json.decode(value)
        return body
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError):
        return None


async def read_capped(resp: aiohttp.ClientResponse, cap: int, replica: str) -> bytes:
    """A replica's whole answer, at most ``cap`` bytes: a 502 from its Content-Length alone when that says
    more, else as soon as what was read passes ``cap``. The caller closes ``resp`` on an exception."""
    too_big = upstream_error(502, f"replica {replica} answered more than {cap} bytes (--max-response-bytes)",
                             "upstream_response_too_large")
    if resp.content_length is not None and resp.content_length > cap:
        raise too_big
    body = bytearray()
    async for chunk in resp.content.iter_chunked(READ_CHUNK):
        body += chunk
        if len(body) > cap:
            raise too_big
    return bytes(body)


class ProxyState:
    """The router's own bookkeeping as a proxy: requests in it (for the ``max_in_flight`` cap) and the error
    answers it gave itself, by HTTP status."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.active = 0        # requests from their first byte until their answer is over (a stream relayed)
        self.errors = Counter("radixrelay_router_errors", "Error answers the router gave itself (not a "
                              "replica's), by HTTP status.", ["status"], registry=registry)
        Gauge("radixrelay_router_in_flight", "Requests in the router: their body being read, waiting for a "
              "replica, or their answer being relayed.", registry=registry).set_function(lambda: self.active)

    def answer(self, error: ProxyError) -> Response:
        self.errors.labels(str(error.status)).inc()
        return error.response()

    def unexpected(self, exc: Exception, path: str) -> Response:
        """A failure this code did not foresee, as a 500 in OpenAI's error JSON; logged (rate-limited)."""
        logger.error("unexpected error answering %s", path, exc_info=exc)
        return self.answer(ProxyError(500, f"the router failed: {type(exc).__name__}", "server_error"))


def install_error_handlers(app: Starlette, state: ProxyState) -> None:
    """The router's own errors, routing errors (404 unknown path, 405 wrong method) and anything unexpected
    answer with OpenAI's error JSON, as the server's do: never FastAPI's ``{"detail": ...}`` or a plain-text
    500."""
    async def proxy_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProxyError)
        return state.answer(exc)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), code=code, headers=exc.headers)

    async def unexpected_error(request: Request, exc: Exception) -> Response:
        return state.unexpected(exc, request.url.path)

    app.add_exception_handler(ProxyError, proxy_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected_error)
