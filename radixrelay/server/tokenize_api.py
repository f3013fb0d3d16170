"""``POST /tokenize`` and ``POST /detokenize``, in the shapes vLLM serves them.

``/tokenize`` takes a completion ``prompt`` (text) or chat ``messages`` (rendered with the server's chat
template, as ``/v1/chat/completions`` renders them) and answers the ids the server would serve::

    {"prompt": "Hello"}                      -> {"count": 2, "max_model_len": 8192, "tokens": [1, 19556],
                                                 "token_strs": null}
    {"messages": [...], "add_generation_prompt": true, "return_token_strs": true}
    {"messages": [...], "tools": [...], "chat_template_kwargs": {...}}     # as a chat request renders them

``add_special_tokens`` defaults to what serving does: true for a prompt (BOS where the model adds one),
false for messages (the template writes its own). ``/detokenize`` answers ``{"prompt": text}`` for
``{"tokens": [ids]}``, special tokens included. Unknown fields, a model other than the served one, both or
neither of prompt and messages, and ids outside the vocabulary are 400s naming the field."""

from __future__ import annotations

from typing import Any

import msgspec

from radixrelay.admission import AdmissionError, checked_ids
from radixrelay.server import openai_protocol as oa
from radixrelay.server.serving import ServingContext
from radixrelay.text.tool_calls import template_tools


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[oa.Tool] | None = None               # rendered with messages, as chat requests render them
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None       # None: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int | float]             # integral floats count as their integer (``checked_ids``)
    model: str | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


def _check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise oa.invalid(f"model {model!r} does not exist; this server serves {ctx.model_name!r}", "model")


def tokenize(ctx: ServingContext, body: bytes) -> TokenizeResponse:
    """``/tokenize`` (CPU work: the caller runs it off the event loop for large bodies)."""
    req: TokenizeRequest = oa.decode_body(body, TokenizeRequest)
    _check_model(ctx, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise oa.invalid("give either prompt (text) or messages, not both", "prompt")
    if req.messages is not None:
        template = ctx.chat_template
        if template is None:
            raise oa.invalid(f"model {ctx.model_name!r} has no chat template; tokenize a prompt instead",
                             "messages")
        try:
            text = template.render(req.messages, add_generation_prompt=req.add_generation_prompt,
                                   tools=template_tools(msgspec.to_builtins(req.tools)),
                                   **oa.template_kwargs(req.chat_template_kwargs))
        except ValueError as exc:
            raise oa.invalid(str(exc), "messages") from None
        special = False if req.add_special_tokens is None else req.add_special_tokens
    else:
        assert req.prompt is not None
        text = req.prompt
        special = True if req.add_special_tokens is None else req.add_special_tokens
    tokens = ctx.tokenizer.encode_array(text, special).tolist()
    strs = [ctx.tokenizer.id_to_token(t) for t in tokens] if req.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=ctx.client.info.max_context, tokens=tokens,
                            token_strs=strs)


def detokenize(ctx: ServingContext, body: bytes) -> DetokenizeResponse:
    """``/detokenize``: the text of ``tokens``, special tokens kept."""
    req: DetokenizeRequest = oa.decode_body(body, DetokenizeRequest)
    _check_model(ctx, req.model)
    if not req.tokens:
        return DetokenizeResponse(prompt="")
    try:
        ids = checked_ids(req.tokens, ctx.client.info.vocab_size, "tokens")
    except AdmissionError as exc:
        raise oa.invalid(str(exc).replace("prompt token ids", "tokens"), "tokens") from None
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(ids, skip_special_tokens=False))
