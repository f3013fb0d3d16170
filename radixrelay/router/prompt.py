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
        the template refuses: routed by load alone; the replica gives the client its error)."""
        try:
            if endpoint == "chat":
                if self.template is None or not isinstance(body.get("messages"), list):
                    return None
                return self.tokenizer.encode(self.template.render(body["messages"]), False)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt, True)
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
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
