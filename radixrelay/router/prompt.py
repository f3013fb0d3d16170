"""A request's prompt as the router sees it: token ids as an int32 array (the replicas' tokenizer and chat
template, ``Tokenizer.encode_array``; a list of ids checked and converted in C-speed passes), then the keys
of its approximate index under the request's ``cache_salt``, so that requests of different salts never
share a route's cached tokens.

The approximate index's keys are 64-bit chained page hashes (``radixrelay.radix.page_hash``), all pages in
one numpy pass, 8 bytes each: they live in this router's memory only, and a collision costs a worse route,
never a wrong answer (the replica matches tokens itself). Precise mode looks the replicas' own content keys
up instead (``radixrelay.router.kv_index``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from radixrelay.radix.page_hash import chain_hashes, seed_of
from radixrelay.text.chat_template import ChatTemplate
from radixrelay.text.tokenizer import Tokenizer
from radixrelay.text.tool_calls import template_tools

# The router's own page size for its index (the replicas' pages may differ: a match is a guess anyway).
PAGE_TOKENS = 64
NAMESPACE = "radixrelay-router"
MAX_SEEDS = 4096          # salts' seeds kept (salts come from clients: bounded)
# Token ids the router takes in a completions prompt: [0, 2^31), which every vocabulary fits in (the replica
# checks its own); larger ones are no token of any model (the router keeps ids as int32).
TOKEN_ID_LIMIT = 1 << 31


class InvalidPrompt(Exception):
    """A prompt no replica could take (the router answers 400 itself)."""


@dataclass(frozen=True)
class Prompt:
    token_ids: np.ndarray                 # int32 [n], n > 0
    salt: str | None


def token_id_array(prompt: list) -> np.ndarray | None:
    """A completions prompt given as a list of token ids, as int32; None when it is not one (a list of
    anything but ints: bools and floats are not ids); ``InvalidPrompt`` for ids out of [0, TOKEN_ID_LIMIT).
    Two C-speed passes over the list, no Python step per id."""
    if set(map(type, prompt)) != {int}:
        return None
    try:
        ids = np.fromiter(prompt, dtype=np.int64, count=len(prompt))
    except OverflowError:                 # past int64
        ids = None
    if ids is None or ids.min() < 0 or ids.max() >= TOKEN_ID_LIMIT:
        raise InvalidPrompt(f"prompt token ids must be in [0, {TOKEN_ID_LIMIT})")
    return ids.astype(np.int32)


class PromptKeys:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self._seeds: dict[str | None, int] = {}

    def token_ids(self, endpoint: str, body: dict[str, Any]) -> np.ndarray | None:
        """The prompt's tokens (int32), or None when they cannot be known here (a batch of prompts, a chat
        the template refuses: routed by load alone; the replica gives the client its error).
        ``InvalidPrompt``: token ids out of [0, TOKEN_ID_LIMIT)."""
        prompt = body.get("prompt") if endpoint != "chat" else None
        if isinstance(prompt, np.ndarray):        # parsed as ids already (``proxy.parse_object``): >= 0
            if len(prompt) and prompt.max() >= TOKEN_ID_LIMIT:
                raise InvalidPrompt(f"prompt token ids must be in [0, {TOKEN_ID_LIMIT})")
            return prompt.astype(np.int32)
        if isinstance(prompt, list) and prompt:
            return token_id_array(prompt)
        try:
            if endpoint == "chat":
                if self.template is None or not isinstance(body.get("messages"), list):
                    return None
                return self.tokenizer.encode_array(self._render_chat(body), False)
            if isinstance(prompt, str):
                return self.tokenizer.encode_array(prompt, True)
        except (ValueError, TypeError, KeyError):
            return None
        return None

    def _render_chat(self, body: dict[str, Any]) -> str:
        """The chat prompt as a replica renders it: with the request's tools, ``chat_template_kwargs`` and
        ``reasoning_effort`` (``ValueError``/``TypeError`` for what a replica would refuse)."""
        assert self.template is not None
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            raise TypeError("chat_template_kwargs is not an object")
        extra = dict(extra)
        if isinstance(body.get("reasoning_effort"), str):
            extra.setdefault("reasoning_effort", body["reasoning_effort"])
        return self.template.render(body["messages"], tools=template_tools(body.get("tools")), **extra)

    def prompt(self, endpoint: str, body: dict[str, Any]) -> Prompt | None:
        """The request's prompt tokens and salt, or None when its tokens cannot be known here."""
        ids = self.token_ids(endpoint, body)
        if ids is None or not len(ids):
            return None
        salt = body.get("cache_salt")
        return Prompt(ids, salt if isinstance(salt, str) else None)

    def keys_of(self, prompt: Prompt) -> list[bytes]:
        """The router's own page keys of ``prompt`` (its approximate index): 8 bytes a page."""
        seed = self._seeds.get(prompt.salt)
        if seed is None:
            if len(self._seeds) >= MAX_SEEDS:
                self._seeds.clear()
            seed = self._seeds[prompt.salt] = seed_of(NAMESPACE, prompt.salt)
        packed = chain_hashes(prompt.token_ids, PAGE_TOKENS, seed).tobytes()
        return [packed[i:i + 8] for i in range(0, len(packed), 8)]

    def keys(self, endpoint: str, body: dict[str, Any]) -> list[bytes]:
        prompt = self.prompt(endpoint, body)
        return [] if prompt is None else self.keys_of(prompt)
