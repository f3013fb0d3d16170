"""An OpenAI-compatible HTTP client that times each request: time to first token and the gaps
between streamed chunks, read from the server-sent events as they arrive.

Works against any server speaking OpenAI's ``/v1/chat/completions`` or ``/v1/completions``
(radixrelay, vLLM, SGLang). Streaming asks for ``stream_options.include_usage`` so the final chunk
carries ``usage`` (prompt, completion and ``prompt_tokens_details.cached_tokens``). Failures of any
kind (refused connection, HTTP error status, an ``error`` event mid-stream, a timeout) come back
as a ``Reply`` with ``ok=False`` and a message; ``send`` never raises for them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Endpoint = Literal["chat", "completions"]
Message = dict[str, str]


@dataclass(frozen=True)
class ClientConfig:
    base_url: str               # server root, e.g. http://127.0.0.1:30000 (no /v1)
    endpoint: Endpoint = "chat"
    model: str = "default"
    api_key: str | None = None
    stream: bool = True
    temperature: float = 0.0
    ignore_eos: bool = True     # an extension of vLLM, SGLang and radixrelay: exact output lengths
    timeout: float = 600.0      # seconds to connect, and for each read of the reply


@dataclass
class Reply:
    ok: bool = False
    error: str | None = None
    text: str = ""
    latency: float = 0.0                # seconds, request sent -> last byte
    ttft: float | None = None           # seconds, request sent -> first content chunk
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    prompt_tokens: int | None = None    # from usage; None when the server reported none
    completion_tokens: int | None = None
    cached_tokens: int | None = None


def render_prompt(messages: list[Message]) -> str:
    """Messages as one plain-text prompt for ``/v1/completions``: a lone user message is sent
    as is; a conversation as ``Role: content`` paragraphs ending with ``Assistant:``."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    body = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)
    return f"{body}\n\nAssistant:"


# Requests in flight per connection pool. httpx's pool scans all of its connections whenever a request
# starts or ends, so one pool serving N concurrent streams costs O(N) per request: at saturation (2,000
# streams in flight) a single pool used the client's whole core and capped the load it could offer.
# Requests are spread over pools of about this many streams each.
STREAMS_PER_POOL = 32


class BenchClient:
    def __init__(self, config: ClientConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """``transport``: httpx's default (real sockets) unless given, e.g. a mock in tests."""
        self.config = config
        self._transport = transport
        self._pools: list[httpx.AsyncClient] = []     # pool i serves requests whose slot is i
        self._free_slots: list[int] = []              # slots of finished requests, reused first
        self._next_slot = 0

    def _pool(self, slot: int) -> httpx.AsyncClient:
        index = slot // STREAMS_PER_POOL
        while len(self._pools) <= index:
            c = self.config
            headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
            self._pools.append(httpx.AsyncClient(
                base_url=c.base_url.rstrip("/"), headers=headers, transport=self._transport,
                timeout=c.timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)))
        return self._pools[index]

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for pool in self._pools:
            await pool.aclose()

    def body(self, messages: list[Message], max_tokens: int) -> dict[str, Any]:
        c = self.config
        body: dict[str, Any] = {"model": c.model, "max_tokens": max_tokens,
                                "temperature": c.temperature, "stream": c.stream}
        if c.ignore_eos:
            body["ignore_eos"] = True
        if c.stream:
            body["stream_options"] = {"include_usage": True}
        if c.endpoint == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = render_prompt(messages)
        return body

    async def send(self, messages: list[Message], max_tokens: int) -> Reply:
        path = "/v1/chat/completions" if self.config.endpoint == "chat" else "/v1/completions"
        reply = Reply()
        # A slot per request in flight (a freed one first): slots map to pools, so concurrent
        # streams fill pools of STREAMS_PER_POOL and a finished stream's connection is reused.
        slot = self._free_slots.pop() if self._free_slots else self._take_slot()
        try:
            await self._send(self._pool(slot), path, messages, max_tokens, reply)
        finally:
            self._free_slots.append(slot)
        reply.ok = reply.error is None
        return reply

    def _take_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1

    async def _send(self, http: httpx.AsyncClient, path: str, messages: list[Message], max_tokens: int,
                    reply: Reply) -> None:
        start = time.perf_counter()
        try:
            request = http.build_request("POST", path, json=self.body(messages, max_tokens))
            response = await http.send(request, stream=True)
            try:
                if response.status_code != 200:
                    await response.aread()
                    reply.error = f"HTTP {response.status_code}: {_error_message(response.content)}"
                elif self.config.stream:
                    await self._read_stream(response, reply, start)
                else:
                    await response.aread()
                    _read_json(response.json(), reply)
                    reply.ttft = time.perf_counter() - start
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            reply.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except ValueError as exc:                   # a body that is not the JSON it should be
            reply.error = f"bad response: {exc}"
        reply.latency = time.perf_counter() - start

    async def _read_stream(self, response: httpx.Response, reply: Reply, start: float) -> None:
        last: float | None = None
        pieces: list[str] = []
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                reply.error = f"stream error: {_message_of(chunk)}"
                return
            _read_usage(chunk.get("usage"), reply)
            piece = "".join(_choice_text(c) for c in chunk.get("choices") or [])
            if not piece:
                continue
            now = time.perf_counter()
            if last is None:
                reply.ttft = now - start
            else:
                reply.itl.append(now - last)
            last = now
            pieces.append(piece)
        reply.text = "".join(pieces)
        if not done:
            reply.error = "stream ended before 'data: [DONE]'"
        elif reply.ttft is None and reply.completion_tokens != 0:
            reply.error = "stream ended without any output"


def _choice_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


def _read_json(body: Any, reply: Reply) -> None:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise ValueError("no choices in the response")
    message = choices[0].get("message")
    if isinstance(message, dict):
        reply.text = message.get("content") or ""
    else:
        reply.text = choices[0].get("text") or ""
    _read_usage(body.get("usage"), reply)


def _read_usage(usage: dict[str, Any] | None, reply: Reply) -> None:
    if not usage:
        return
    reply.prompt_tokens = usage.get("prompt_tokens")
    reply.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    reply.cached_tokens = details.get("cached_tokens")


def _message_of(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error if error is not None else body)


def _error_message(content: bytes) -> str:
    try:
        return _message_of(json.loads(content))
    except ValueError:
        return content.decode(errors="replace")[:500]


async def served_model(base_url: str, api_key: str | None, timeout: float = 10.0) -> str | None:
    """The first model ``GET /v1/models`` lists, or None when the server cannot say."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout, headers=headers) as http:
            response = await http.get(f"{base_url.rstrip('/')}/v1/models")
            data = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return data[0].get("id")
    return None
