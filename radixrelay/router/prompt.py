"""A request's prompt as the router sees it: token ids (the replicas' tokenizer and chat template), then
page keys (``radixrelay.radix.page_keys``) under the request's ``cache_salt``, so that requests of
different salts never share a route's cached tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixrelay.radix.page_keys import chain_seed, extend_keys
from radixrelay.text.chat_template import ChatTemplate
from radixrelay.text.tokenizer import Tokenizer

# The router's own page size for its index (the replicas' pages may differ: a match is a guess anyway).
PAGE_TOKENS = 64
NAMESPACE = "radixrelay-router"
# Token ids the router takes in a completions prompt: [0, 2^31), which every vocabulary fits in (the replica
# checks its own); larger ones could not be hashed into page keys (int64) and are no token of any model.
TOKEN_ID_LIMIT = 1 << 31


class InvalidPrompt(Exception):
    """A prompt no replica could take (the router answers 400 itself)."""


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    salt: str | None


class PromptKeys:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> None:
        self.tokenizer = tokenizer
        self.template = template

    def token_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's tokens, or None when they cannot be known here (a batch of prompts, a chat
        the template refuses: routed by load alone; the replica gives the client its error).
        ``InvalidPrompt``: token ids out of [0, TOKEN_ID_LIMIT)."""
        prompt = body.get("prompt") if endpoint != "chat" else None
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt) and \
                not all(0 <= t < TOKEN_ID_LIMIT for t in prompt):
            raise InvalidPrompt(f"prompt token ids must be in [0, {TOKEN_ID_LIMIT})")
        try:
            if endpoint == "chat":
                if self.template is None or not isinstance(body.get("messages"), list):
                    return None
                return self.tokenizer.encode(self.template.render(body["messages"]), False)
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt, True)
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):    # no bools
                return list(prompt)
        except (ValueError, TypeError, KeyError):
            return None
        return None

    def prompt(self, endpoint: str, body: dict[str, Any]) -> Prompt | None:
        """The request's prompt tokens and salt, or None when its tokens cannot be known here."""
        ids = self.token_ids(endpoint, body)
        if not ids:
            return None
        salt = body.get("cache_salt")
        return Prompt(ids, salt if isinstance(salt, str) else None)

    @staticmethod
    def keys_of(prompt: Prompt) -> list[bytes]:
        """The router's own page keys of ``prompt`` (its approximate index)."""
        seed = chain_seed(NAMESPACE, prompt.salt)
        return extend_keys([], seed, prompt.token_ids, PAGE_TOKENS, len(prompt.token_ids) // PAGE_TOKENS)

    def keys(self, endpoint: str, body: dict[str, Any]) -> list[bytes]:
        prompt = self.prompt(endpoint, body)
        return [] if prompt is None else self.keys_of(prompt)
