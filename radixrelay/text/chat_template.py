"""Chat templates: validate OpenAI-style messages and render them with the model's Jinja template.

Rendering follows Hugging Face's ``apply_chat_template`` conventions so that templates written for
it work unchanged: a sandboxed immutable Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, a ``tojson`` filter that keeps non-ASCII characters, a ``raise_exception``
helper, a ``strftime_now`` helper, ``{% break %}`` / ``{% continue %}``, and the variables
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` (plus any extra keyword
variables the caller passes: ``chat_template_kwargs`` such as ``enable_thinking``).

Tools: ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) reach the template as the
variable ``tools``, and an assistant turn's ``tool_calls`` keep their place in its message with each
call's ``arguments`` as an object, as Hugging Face's ``apply_chat_template`` callers pass them. A
template that never reads ``tools`` gets the generic fallback instead
(``tool_calls.fallback_messages``): the tools described in the system message, calls and results
written out as ``<tool_call>`` / ``<tool_response>`` blocks in plain turns.

Templates are untrusted code (a model's files may carry one): the sandbox refuses access to Python
internals (``''.__class__.__mro__`` raises ``SecurityError``), and ``_BoundedSandbox`` also refuses
``*`` / ``**`` results past ``MAX_REPEAT`` items or ``MAX_POWER`` (``'a' * 10**10`` would
allocate gigabytes); ranges are capped by Jinja's own sandbox. A template that reaches for internals
while rendering a plain conversation is refused when it is loaded; any failure while rendering is a
``ChatTemplateError`` (a 400), never an unhandled exception. What the sandbox does not bound is
CPU time: loops over capped ranges still multiply, so a template is trusted to terminate.
Message contents are data to the template, never template code: ``{{ ... }}`` in a message is text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from radixrelay.text.tokenizer import Tokenizer
from radixrelay.text.tool_calls import fallback_messages, template_messages, template_supports_tools

ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_REPEAT = 1_000_000      # items (characters) a `*` repetition may produce in a template
MAX_POWER = 10_000          # largest exponent / base magnitude `**` may take in a template
_PROBE = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello"}]


class ChatTemplateError(ValueError):
    """The template raised (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    ensure_ascii: bool = False,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, indent=indent, separators=separators, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, plus bounds on the two operators that allocate without limit."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) \
                        and len(seq) * count > MAX_REPEAT:
                    raise SecurityError(f"the template repeats a sequence past {MAX_REPEAT} items")
        if operator == "**" and isinstance(right, (int, float)) and isinstance(left, (int, float)) \
                and (abs(right) > MAX_POWER or abs(left) > MAX_POWER):
            raise SecurityError(f"the template raises a number past {MAX_POWER} to a power")
        return super().call_binop(context, operator, left, right)


def _compile(template: str, origin: str) -> jinja2.Template:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{origin} does not compile: {exc}") from exc


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and content; returns plain dicts the template may index.

    ``content`` is a string, ``None`` (an assistant turn that only calls tools) or a list of
    ``{"type": "text", "text": ...}`` parts; text parts are joined into one string, because most
    templates concatenate ``message['content']`` directly.
    """
    if not messages:
        raise ValueError("messages: at least one message is required")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}]: expected an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role: must be one of {sorted(ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, list):
            content = _join_text_parts(content, i)
        elif content is None and role != "assistant":
            raise ValueError(f"messages[{i}].content: required for role {role!r}")
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string or a list of text parts")
        if role == "tool" and not (isinstance(message.get("tool_call_id"), str) and message["tool_call_id"]):
            raise ValueError(f"messages[{i}]: a tool message needs `tool_call_id`, the id of the call it answers")
        calls = message.get("tool_calls")
        if calls is not None and role == "assistant":     # other roles' extra keys pass as they are
            _check_tool_calls(calls, i)
        out.append({**message, "content": content})
    return out


def _check_tool_calls(calls: Any, index: int) -> None:
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise ValueError(f"{where}: expected a list of calls")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str):
            raise ValueError(f"{where}[{j}]: expected {{'id': str, 'type': 'function', 'function': "
                             "{'name': str, 'arguments': str}}")


def _join_text_parts(parts: list[Any], index: int) -> str:
    texts: list[str] = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(
                f"messages[{index}].content[{j}]: only {{'type': 'text', 'text': str}} parts are supported"
            )
        texts.append(part["text"])
    return "".join(texts)


class ChatTemplate:
    """One model's template, compiled once; ``render`` is safe to call from any request. ``given``: the
    template is the user's (``--chat-template``), not the model's own, and errors say so."""

    def __init__(
        self, template: str, *, model_name: str, bos_token: str | None = None, eos_token: str | None = None,
        given: bool = False,
    ) -> None:
        self.model_name = model_name
        self.origin = "the given chat template (--chat-template)" if given else \
            f"the chat template of model {model_name!r}"
        self._compiled = _compile(template, self.origin)
        self.text = template
        self.supports_tools = template_supports_tools(template)
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""
        self._refuse_unsafe()

    def _refuse_unsafe(self) -> None:
        """A template that reaches for Python internals on a plain conversation is refused now
        (other render errors, e.g. a template that insists on alternating roles, are left to the
        requests that trigger them)."""
        try:
            self.render(_PROBE)
        except ChatTemplateError as exc:
            if isinstance(exc.__cause__, SecurityError):
                raise ChatTemplateError(f"{self.origin} is unsafe: {exc.__cause__}") from exc.__cause__

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, override: str | None = None) -> ChatTemplate:
        """The tokenizer's template (or ``override``); ``ValueError`` naming the model if none."""
        template = override if override is not None else tokenizer.chat_template
        if template is None:
            raise ValueError(
                f"model {tokenizer.name!r} has no chat template; use the completions endpoint "
                "or pass a chat template"
            )
        return cls(template, model_name=tokenizer.name, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                   given=override is not None)

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, **extra: Any
    ) -> str:
        """The prompt text for ``messages`` (validated first); ``tools`` as the template expects them
        (or the generic fallback); extra keywords become template variables."""
        checked = validate_messages(messages)
        if tools or any((m["role"] == "assistant" and m.get("tool_calls")) or m["role"] == "tool" for m in checked):
            if self.supports_tools:
                checked = template_messages(checked)
                if tools:
                    extra["tools"] = tools
            else:
                checked = fallback_messages(checked, tools)
        variables = {**extra, "messages": checked, "add_generation_prompt": add_generation_prompt,
                     "bos_token": self._bos_token, "eos_token": self._eos_token}
        try:
            return self._compiled.render(variables)      # one mapping: any variable name passes
        except ChatTemplateError:
            raise
        except (ValueError, MemoryError):
            raise                # validate_messages (a 400 naming the message) / out of memory
        except Exception as exc:  # noqa: BLE001 - any render failure is the template's: TypeError,
            # ZeroDivisionError, OverflowError (a capped range), RecursionError, SecurityError, ...
            raise ChatTemplateError(f"{self.origin} failed: {type(exc).__name__}: {exc}") from exc
