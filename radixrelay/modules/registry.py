"""The schemas a server (or Engine) knows: register PML once, compose prompts against it per request.

Pure: tokenisation is the caller's ``encode`` (text -> ids, no BOS or other special tokens added);
nothing here imports torch. A registry is safe to share between threads: entries are immutable and
replaced whole under a lock, so a request composes against one version of a schema throughout.

Identity. A schema is registered under its name. Its ``digest`` is the SHA-256 of the model id and
the schema's canonical PML (``to_pml(schema, indent=None)``), so it changes with any edit and
differs between models; it namespaces the schema's module KV (``compose.module_key``).
Re-registering a name:
    * with the same digest: idempotent (the existing entry is returned, its ``created`` kept);
    * with another digest: replaces the entry. Requests already composed keep the old digest's
      spans; that KV is no longer reachable by new requests and is evicted like any unused KV.
Deleting a name only forgets the schema; its cached KV is evicted the same way.

Chat. Roles in a schema or prompt become the model's chat markers: ``chat_role_text`` renders the
chat template around a sentinel for each role; ``chat_generation_prompt`` is what the template
appends to ask for the assistant's turn (the ``suffix_ids`` of a chat prompt). The template's own
extras (a default system message, a date line) are not added: the schema says what the prompt is.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol
from xml.sax.saxutils import quoteattr

import msgspec

from .compose import ComposedPrompt, compose
from .layout import Encode, RoleText, SchemaLayout, layout
from .pml import ROLES, DEFAULT_LIMITS, Import, Limits, Module, Prompt, Role, Schema, SchemaError, Union, \
    parse_schema, prompt_from_json, prompt_from_str, to_pml

if TYPE_CHECKING:
    from radixrelay.text.chat_template import ChatTemplate

DEFAULT_MAX_SCHEMAS = 64
DEFAULT_MAX_TOKENS = 1 << 22          # module tokens held by all schemas together (ids + positions)
_SENTINEL = "RADIXRELAY_SENTINEL_9F2C"   # text no template writes on its own


class UnknownSchemaError(SchemaError):
    """No schema of that name is registered (a 404 on /v1/schemas/{name}, a 400 in a request)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"schema {name!r} is not registered (register it with POST /v1/schemas)")
        self.name = name


# ─────────────────────────────────────────────────────────────────────────── info


class ParamInfo(msgspec.Struct, frozen=True):
    name: str
    len: int


class ModuleSummary(msgspec.Struct, frozen=True):
    """A named module: its span ``[start, end)`` of positions (nested children included), its own
    tokens (params' placeholders included), and where it sits."""

    name: str
    start: int
    end: int
    num_tokens: int
    params: list[ParamInfo]
    parent: str | None = None
    union: int | None = None


class ScaffoldSummary(msgspec.Struct, frozen=True):
    name: str
    modules: list[str]


class SchemaInfo(msgspec.Struct, frozen=True):
    """What a registered schema is, as /v1/schemas reports it. ``num_tokens``: tokens of all its
    modules and anonymous text (the module KV it can hold, before page padding); ``end_position``:
    the first position after the schema."""

    name: str
    digest: str
    model: str
    created: int
    num_tokens: int
    end_position: int
    modules: list[ModuleSummary]
    scaffolds: list[ScaffoldSummary]
    object: str = "schema"


class _Entry(msgspec.Struct, frozen=True):
    info: SchemaInfo
    layout: SchemaLayout


def schema_digest(model_id: str, schema: Schema, limits: Limits | None = None) -> str:
    """SHA-256 (hex) of ``model_id`` and the canonical PML of ``schema`` (validated on the way)."""
    canonical = to_pml(schema, indent=None, limits=limits)
    h = hashlib.sha256()
    for part in (model_id, canonical):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))     # length-prefixed: no ambiguous concatenation
        h.update(data)
    return h.hexdigest()


def _info(lay: SchemaLayout, digest: str, model_id: str, created: int) -> SchemaInfo:
    named = [m for m in lay.modules.values() if not m.anonymous]
    modules = [ModuleSummary(m.name, m.start, m.end, len(m.token_ids),
                             [ParamInfo(p, length) for p, (_, length) in m.params.items()], m.parent, m.union)
               for m in named]
    scaffolds = [ScaffoldSummary(name, list(members)) for name, members in lay.scaffolds.items()]
    return SchemaInfo(lay.schema_name, digest, model_id, created,
                      sum(len(m.token_ids) for m in lay.modules.values()), lay.end, modules, scaffolds)


# ─────────────────────────────────────────────────────────────────────── registry


class SchemaRegistry:
    """Registered schemas of one model. ``encode`` must add no special tokens; ``placeholder_id``
    fills params without a value and pads spans to pages; ``role_text`` gives each role's (begin,
    end) markers (a mapping or a callable; None: schemas and prompts with roles are refused);
    ``generation_prompt``: the text that opens the assistant's turn in ``compose_chat`` (None: chat
    prompts are refused)."""

    def __init__(self, encode: Encode, *, model_id: str, page_size: int, placeholder_id: int,
                 role_text: RoleText | Mapping[str, tuple[str, str]] | None = None,
                 generation_prompt: str | None = None, limits: Limits | None = None,
                 max_schemas: int = DEFAULT_MAX_SCHEMAS, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if max_schemas < 1 or max_tokens < 1:
            raise ValueError("max_schemas and max_tokens must be >= 1")
        self.encode = encode
        self.model_id = model_id
        self.page_size = page_size
        self.placeholder_id = placeholder_id
        self.role_text: RoleText | None = (role_text.__getitem__ if isinstance(role_text, Mapping)
                                            else role_text)
        self.generation_prompt = generation_prompt
        self.limits = limits or DEFAULT_LIMITS
        self.max_schemas = max_schemas
        self.max_tokens = max_tokens
        self._entries: dict[str, _Entry] = {}     # replaced whole, under _lock
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: _Tokenizer, *, model_id: str, page_size: int,
                      chat_template: str | None = None, **options: Any) -> SchemaRegistry:
        """A registry wired to a ``radixrelay.text.tokenizer.Tokenizer``: encode without special
        tokens, the whitespace placeholder, and markers from the chat template (``chat_template``
        overrides the tokenizer's, as ``--chat-template`` does)."""
        template = _template(tokenizer, chat_template)
        markers = None if template is None else _role_markers(template)
        return cls(lambda text: tokenizer.encode(text, add_special_tokens=False), model_id=model_id,
                   page_size=page_size, placeholder_id=placeholder_token(tokenizer), role_text=markers,
                   generation_prompt=None if template is None or markers is None else _generation_prompt(template),
                   **options)

    # -- schemas ----------------------------------------------------------------------------

    def register(self, pml: str | bytes | Schema) -> SchemaInfo:
        """Parse (or validate) and lay out a schema; rules for a name already taken in the module
        docstring. SchemaError for invalid PML or past ``max_schemas`` / ``max_tokens``."""
        schema = pml if isinstance(pml, Schema) else parse_schema(pml, self.limits)
        digest = schema_digest(self.model_id, schema, self.limits)    # validates a built Schema too
        self._check_roles(schema.children, f"schema {schema.name!r}")
        with self._lock:
            old = self._entries.get(schema.name)
            if old is not None and old.info.digest == digest:
                return old.info
            self._check_room(schema.name, 0)
        lay = layout(schema, self.encode, placeholder_id=self.placeholder_id, role_text=self.role_text,
                     limits=self.limits)
        entry = _Entry(_info(lay, digest, self.model_id, int(time.time())), lay)
        with self._lock:                  # checked again: another thread may have registered meanwhile
            self._check_room(schema.name, entry.info.num_tokens)
            self._entries[schema.name] = entry
        return entry.info

    def _check_room(self, name: str, num_tokens: int) -> None:
        others = [e for n, e in self._entries.items() if n != name]
        if len(others) >= self.max_schemas:
            raise SchemaError(f"schema {name!r}: {len(others)} schemas are registered, the most this "
                              f"server holds ({self.max_schemas}); delete one first")
        held = sum(e.info.num_tokens for e in others)
        if held + num_tokens > self.max_tokens:
            raise SchemaError(f"schema {name!r}: its {num_tokens} tokens and the {held} of the other "
                              f"schemas exceed the {self.max_tokens} tokens this server holds")

    def _check_roles(self, nodes: Sequence[object], what: str) -> None:
        """Roles need chat markers: without them a role would silently add nothing."""
        if self.role_text is None and _has_roles(nodes):
            raise SchemaError(f"{what} uses chat roles, but this model has no chat template whose roles "
                              "can be written as markers; write the text without <system>/<user>/<assistant>")

    def get(self, name: str) -> SchemaInfo:
        return self._entry(name).info

    def list(self) -> list[SchemaInfo]:
        """Every registered schema, by name."""
        with self._lock:
            return [self._entries[n].info for n in sorted(self._entries)]

    def delete(self, name: str) -> bool:
        """Forget ``name``; False if it was not registered."""
        with self._lock:
            return self._entries.pop(name, None) is not None

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise UnknownSchemaError(name)
        return entry

    # -- prompts ----------------------------------------------------------------------------

    def compose(self, name: str, prompt: Prompt | str | bytes | Mapping[str, Any], *,
                salt: str | None = None, suffix_ids: Sequence[int] = ()) -> ComposedPrompt:
        """``prompt`` against schema ``name``: a Prompt, PML text (``<prompt schema=...>``) or the
        JSON form (``prompt_from_json``; its ``"schema"`` may be left out). SchemaError for an
        unknown schema, a prompt naming another schema, an unknown module or a value past ``len``."""
        entry = self._entry(name)
        if isinstance(prompt, Mapping):
            prompt = prompt_from_json(dict(prompt) if "schema" in prompt else {"schema": name, **prompt},
                                      self.limits)
        elif isinstance(prompt, (str, bytes)):
            prompt = prompt_from_str(prompt, self.limits)
        elif not isinstance(prompt, Prompt):
            raise SchemaError(f"prompt: expected PML text, a JSON object or a Prompt, got {type(prompt).__name__}")
        if prompt.schema != name:
            raise SchemaError(f"the prompt is written against schema {prompt.schema!r}, but the request "
                              f"names schema {name!r}")
        self._check_roles(prompt.parts, "the prompt")
        plan = entry.layout.prompt_plan(prompt, self.encode)
        return compose(entry.layout, plan, digest=entry.info.digest, page_size=self.page_size,
                       placeholder_id=self.placeholder_id, salt=salt, suffix_ids=suffix_ids)

    def compose_chat(self, name: str, messages: Sequence[Mapping[str, Any]], *,
                     salt: str | None = None) -> ComposedPrompt:
        """Chat messages whose contents are PML fragments (``prompt_from_messages``), then the
        template's generation prompt as new text."""
        self._entry(name)                 # unknown schema first: the clearest error
        if self.generation_prompt is None:
            raise SchemaError("this model has no chat template: write the prompt for the completions "
                              "endpoint instead")
        prompt = prompt_from_messages(name, messages, self.limits)
        return self.compose(name, prompt, salt=salt, suffix_ids=self.encode(self.generation_prompt))


def _has_roles(nodes: Sequence[object]) -> bool:
    """Whether a role occurs anywhere in validated schema or prompt nodes (depth bounded by Limits)."""
    for node in nodes:
        if isinstance(node, Role):
            return True
        if isinstance(node, (Module, Import)) and _has_roles(node.children):
            return True
        if isinstance(node, Union) and _has_roles(node.members):
            return True
    return False


def prompt_from_messages(schema_name: str, messages: Sequence[Mapping[str, Any]],
                         limits: Limits | None = None) -> Prompt:
    """Chat messages as a prompt against ``schema_name``: each message becomes a role whose
    children are its ``content`` read as PML (text and module imports such as ``<doc-a/>``; ``<``
    and ``&`` in plain text must be escaped). Content is a string, a list of text parts, or None."""
    limits = limits or DEFAULT_LIMITS
    if not messages:
        raise SchemaError("messages: at least one message is required")
    roles: list[Role] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ROLES:
            raise SchemaError(f"messages[{i}].role: a prompt against a schema has roles "
                              f"{', '.join(ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise SchemaError(f"messages[{i}].content: only {{'type': 'text', 'text': str}} parts are supported")
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise SchemaError(f"messages[{i}].content: expected a string or a list of text parts")
        try:
            parsed = prompt_from_str(f"<prompt schema={quoteattr(schema_name)}>{content}</prompt>", limits)
        except SchemaError as exc:
            raise SchemaError(f"messages[{i}].content: {exc}") from None
        roles.append(Role(role, parsed.parts))
    return Prompt(schema_name, tuple(roles))


# ─────────────────────────────────────────────────────────── tokenizer helpers


class _Tokenizer(Protocol):
    """What the helpers need of ``radixrelay.text.tokenizer.Tokenizer``."""

    eos_token_id: int | None
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def placeholder_token(tokenizer: _Tokenizer) -> int:
    """The id params and page padding are filled with: " " if it is one token, else "\\n", else
    the EOS token (whitespace-like, as the paper suggests)."""
    for text in (" ", "\n"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            return ids[0]
    if tokenizer.eos_token_id is None:
        raise ValueError("no placeholder token: neither ' ' nor '\\n' is one token and there is no EOS")
    return tokenizer.eos_token_id


def _template(tokenizer: _Tokenizer, override: str | None) -> ChatTemplate | None:
    from radixrelay.text.chat_template import ChatTemplate   # jinja2: only when a template is used

    if override is None and tokenizer.chat_template is None:
        return None
    return ChatTemplate.for_tokenizer(tokenizer, override)  # type: ignore[arg-type]


def chat_role_text(tokenizer: _Tokenizer, override: str | None = None) -> dict[str, tuple[str, str]] | None:
    """(begin, end) marker text per role from the chat template (``override`` or the tokenizer's);
    None when there is no template or it does not render roles one after another (each message's
    text must not depend on the ones after it)."""
    template = _template(tokenizer, override)
    return None if template is None else _role_markers(template)


def chat_generation_prompt(tokenizer: _Tokenizer, override: str | None = None) -> str | None:
    """The text the chat template appends for ``add_generation_prompt`` (None: no template)."""
    template = _template(tokenizer, override)
    return None if template is None else _generation_prompt(template)


_CONTEXT: Mapping[str, tuple[Mapping[str, str], ...]] = {
    "system": (),
    "user": ({"role": "system", "content": "A"},),
    "assistant": ({"role": "system", "content": "A"}, {"role": "user", "content": "B"}),
}


def _role_markers(template: ChatTemplate) -> dict[str, tuple[str, str]] | None:
    """Render each role's message after a short conversation (a system message before a user
    message, both before an assistant one) and cut the sentinel out of what the message added;
    None unless the markers rebuild a whole conversation exactly."""
    markers: dict[str, tuple[str, str]] = {}
    try:
        for role in ROLES:
            before = template.render(_CONTEXT[role], add_generation_prompt=False) if _CONTEXT[role] else ""
            full = template.render([*_CONTEXT[role], {"role": role, "content": _SENTINEL}],
                                   add_generation_prompt=False)
            if not full.startswith(before) or full.count(_SENTINEL) != 1:
                return None
            begin, end = full[len(before):].split(_SENTINEL)
            markers[role] = (begin, end)
        # The markers must rebuild a whole conversation as the template renders it.
        talk = [*_CONTEXT["assistant"], {"role": "assistant", "content": "C"}]
        rebuilt = "".join(markers[m["role"]][0] + m["content"] + markers[m["role"]][1] for m in talk)
        if template.render(talk, add_generation_prompt=False) != rebuilt:
            return None
    except ValueError:            # ChatTemplateError: e.g. a template that refuses system messages
        return None
    return markers


def _generation_prompt(template: ChatTemplate) -> str | None:
    probe = _CONTEXT["assistant"]
    try:
        without = template.render(probe, add_generation_prompt=False)
        with_it = template.render(probe, add_generation_prompt=True)
    except ValueError:
        return None
    return with_it[len(without):] if with_it.startswith(without) else None


__all__ = ["DEFAULT_MAX_SCHEMAS", "DEFAULT_MAX_TOKENS", "ModuleSummary", "ParamInfo", "ScaffoldSummary",
           "SchemaInfo", "SchemaRegistry", "UnknownSchemaError", "chat_generation_prompt", "chat_role_text",
           "placeholder_token", "prompt_from_messages", "schema_digest"]
