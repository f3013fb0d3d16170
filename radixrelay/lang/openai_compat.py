"""``OpenAICompatible``: a backend for any server with OpenAI's completions API.

Programs accumulate text, so every call is a ``/v1/completions`` request carrying the whole text;
a server with a prefix cache (radixrelay, SGLang, vLLM) finds the shared prefix by itself.
``gen`` streams (``stream_options.include_usage`` for the usage); ``select`` needs prompt
logprobs (``echo`` with ``logprobs``), see ``scoring.py``. One ``httpx.Client`` (thread-safe)
serves every program state and thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx

from radixrelay.lang import scoring
from radixrelay.lang.runtime_backend import CallMeta, Generation, Usage
from radixrelay.lang.chat import RoleMarkers
from radixrelay.lang.errors import BackendError
from radixrelay.lang.expr import Gen
from radixrelay.structured.spec import StructuredOutput
from radixrelay.text.chat_template import ChatTemplate


class OpenAICompatible:
    """``base_url`` ends with the API root (``http://host:8000/v1``). ``chat_template``: role
    markers for ``rl.system/user/assistant``, as ``RoleMarkers`` or a Jinja chat template;
    default ``RoleMarkers.plain()`` (``User: ...`` lines), as the template is not served.
    ``structured_outputs``: whether the server takes ``guided_regex`` / ``guided_json`` /
    ``guided_choice`` (radixrelay, vLLM); a server that refuses them answers 400, a ``BackendError``."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, *,
                 chat_template: RoleMarkers | str | None = None, timeout: float = 600.0,
                 max_connections: int = 256, structured_outputs: bool = True) -> None:
        self.model = model
        self.structured_outputs = structured_outputs
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                                  limits=limits)
        if isinstance(chat_template, str):
            chat_template = RoleMarkers.from_template(ChatTemplate(chat_template, model_name=model, given=True))
        self.markers = chat_template or RoleMarkers.plain()

    def generate(self, prompt: str, gen: Gen, on_text: Callable[[str], None]) -> Generation:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": gen.max_tokens,
                                "n": gen.n, "stream": True, "stream_options": {"include_usage": True}}
        optional = {"stop": list(gen.stop) or None, "temperature": gen.temperature, "top_p": gen.top_p}
        body.update((k, v) for k, v in optional.items() if v is not None)
        if gen.structured is not None:
            body.update(self._constraint_fields(gen.structured))
        texts = [""] * gen.n
        reasons: list[str | None] = [None] * gen.n
        usage = None
        started = time.monotonic()
        for chunk in self._stream("/completions", body):
            for choice in chunk.get("choices") or ():
                i, delta = choice["index"], choice.get("text") or ""
                texts[i] += delta
                if delta and gen.n == 1:
                    on_text(delta)
                if choice.get("finish_reason"):
                    reasons[i] = choice["finish_reason"]
            usage = _usage(chunk.get("usage")) or usage
        return Generation(tuple(texts), CallMeta(started, time.monotonic(), usage, tuple(reasons)))

    def _constraint_fields(self, spec: StructuredOutput) -> dict[str, Any]:
        """vLLM's names, which radixrelay serves too; a backend built with ``structured_outputs=False``
        (a server known to lack them) refuses here rather than have them ignored."""
        if not self.structured_outputs:
            raise BackendError(f"gen with a {spec.kind} constraint: this backend has no structured outputs")
        if spec.kind == "regex":
            return {"guided_regex": spec.value}
        if spec.kind == "choice":
            return {"guided_choice": list(spec.choices)}
        return {"guided_json": json.loads(spec.value) if spec.kind == "json_schema" else {"type": "object"}}

    def score(self, prefix: str, choices: Sequence[str]) -> CallMeta:
        if not prefix:
            raise BackendError("select needs text before it (the choices are scored after a prefix)")
        prompts = [prefix, *(prefix + c for c in choices)]
        body = {"model": self.model, "prompt": prompts, "echo": True, "logprobs": 0,
                "max_tokens": 1, "temperature": 0}
        started = time.monotonic()
        response = self._post("/completions", body, purpose="select (echo + logprobs)")
        entries = {}
        for choice in response.get("choices") or ():
            i = choice["index"]
            entries[i] = scoring.prompt_entries(choice.get("logprobs"), prompts[i])
        if sorted(entries) != list(range(len(prompts))):
            raise BackendError(f"expected {len(prompts)} choices in the select response, got {sorted(entries)}")
        scores = tuple(scoring.choice_score(entries[0], entries[i + 1]) for i in range(len(choices)))
        return CallMeta(started, time.monotonic(), _usage(response.get("usage")), scores=scores)

    def prefill(self, prompt: str) -> CallMeta:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        started = time.monotonic()
        response = self._post("/completions", body, purpose="prefill")
        return CallMeta(started, time.monotonic(), _usage(response.get("usage")))

    def close(self) -> None:
        self._http.close()

    # -- HTTP -------------------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any], purpose: str) -> dict[str, Any]:
        try:
            response = self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise BackendError(f"{purpose}: request to {self._http.base_url}{path.lstrip('/')} failed: {exc}") from exc
        if response.status_code != 200:
            raise BackendError(f"{purpose}: {_error_text(response)}", response.status_code)
        return response.json()

    def _stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        try:
            with self._http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise BackendError(f"gen: {_error_text(response)}", response.status_code)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise BackendError(f"gen failed mid-stream: {_message(event)}")
                    yield event
        except httpx.HTTPError as exc:
            raise BackendError(f"gen: request to {self._http.base_url}{path.lstrip('/')} failed: {exc}") from exc
        raise BackendError("gen: the stream ended without [DONE]")


def _usage(raw: dict[str, Any] | None) -> Usage | None:
    if not raw:
        return None
    details = raw.get("prompt_tokens_details") or {}
    return Usage(raw["prompt_tokens"], raw.get("completion_tokens", 0), details.get("cached_tokens"))


def _message(payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error if error is not None else payload)


def _error_text(response: httpx.Response) -> str:
    try:
        detail = _message(response.json())
    except ValueError:
        detail = response.text[:500]
    return f"server answered {response.status_code}: {detail}"
