"""OpenAI-compatible request and response bodies (msgspec structs) and their validation.

Requests are decoded strictly typed (a wrong type is a 400 naming the field); unknown fields are
ignored, as OpenAI's own clients send fields this server has no use for. ``APIError`` carries the
HTTP status and OpenAI's error JSON. Extensions beyond OpenAI's API: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``cache_salt``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from radixrelay.sampling_params import SamplingParams

# -- errors -----------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


_PATH = re.compile(r"at `\$\.([A-Za-z_]\w*)")


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """JSON body -> ``kind``; malformed JSON or wrong types -> 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        raise invalid(f"invalid request: {exc}", match.group(1) if match else None) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None


# -- requests ---------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class GenerationRequest(msgspec.Struct, kw_only=True):
    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stops):
            raise invalid("stop strings must be non-empty", "stop")
        return stops


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: a string, token ids, or a list of either."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(_is_token(t) for t in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise invalid("prompt must be a string, a list of token ids, or a non-empty list of either",
                  "prompt")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sampling_params(req: GenerationRequest, *, max_tokens: int, logprobs: int | None,
                    seed: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's sampling fields as ``SamplingParams``; out-of-range values -> 400."""
    if req.logit_bias:
        raise invalid("logit_bias is not supported", "logit_bias")
    fields: dict[str, Any] = {
        "max_tokens": max_tokens, "seed": seed, "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs, "stop": req.stop_strings(),
        "stop_token_ids": tuple(req.stop_token_ids or ()), "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
    }
    optional = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                "min_p": req.min_p, "presence_penalty": req.presence_penalty,
                "frequency_penalty": req.frequency_penalty,
                "repetition_penalty": req.repetition_penalty}
    fields.update((k, v) for k, v in optional.items() if v is not None)
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        match = re.match(r"SamplingParams\.(\w+)", str(exc))
        param = match.group(1) if match else None
        if param in ("logprobs", "prompt_logprobs"):
            param = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
        raise invalid(str(exc).removeprefix("SamplingParams."), param) from None


# -- responses --------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort"]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ChatMessage(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]          # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]                      # characters into the choice's text (echo included)


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "radixrelay"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
