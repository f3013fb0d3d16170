"""A stand-in OpenAI completions server that offers prompt logprobs (``echo`` + ``logprobs``),
computed with ``reference.token_logprobs``: what ``select`` needs from any backend.

It answers only that request shape (plus one greedy generated token per prompt, as OpenAI does
with ``max_tokens=1``): token texts and ``text_offset`` as a server would report them.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.lang import reference


def _choice(index: int, prompt: str) -> dict[str, Any]:
    tok = reference.tokenizer()
    ids = tok.encode(prompt)
    values = reference.token_logprobs(ids)
    texts = [tok.decode([i], skip_special_tokens=False) for i in ids]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    generated = " X"                       # the max_tokens=1 token; select must ignore it
    return {"index": index, "text": prompt + generated, "finish_reason": "length",
            "logprobs": {"tokens": [*texts, generated], "token_logprobs": [*values, -1.0],
                         "top_logprobs": None, "text_offset": [*offsets, len(prompt)]}}


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)  # type: ignore[attr-defined]
        if not (body.get("echo") and body.get("logprobs") is not None and body.get("max_tokens") == 1):
            self._send(400, {"error": {"message": "stub: only echo + logprobs + max_tokens=1"}})
            return
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = [_choice(i, p) for i, p in enumerate(prompts)]
        usage = {"prompt_tokens": 0, "completion_tokens": len(prompts), "total_tokens": len(prompts)}
        self._send(200, {"object": "text_completion", "choices": choices, "usage": usage})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class StubServer:
    def __init__(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.requests = []  # type: ignore[attr-defined]
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def requests(self) -> list[dict[str, Any]]:
        return self._server.requests  # type: ignore[attr-defined]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
