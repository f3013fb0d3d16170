"""Tool calls in a model's output: the call formats of the supported families, one registry.

A format (``CallFormat``) knows three things about its family's call syntax: how to find calls in the
output text (``scan``: whole or partial text, for responses and streams alike), how a call is written
(the strings a structural tag forces around a call's arguments, ``constraint``), and how to recognise
its family's chat template (``detects``). Formats:

- ``hermes`` (Qwen 2.5/3, Hermes, and the generic fallback for templates without tool support):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number, text around them.
- ``llama3_json`` (Llama 3.1-3.3 JSON tool calling): the output is ``{"name": ..., "parameters":
  {...}}`` objects separated by ``;``, optionally after ``<|python_tag|>``; no text around them.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after optional text.
- ``mistral_args`` (Mistral's tokenizers from v11 on): ``[TOOL_CALLS]name[ARGS]{...}``, one call after
  another, after optional text.

Arguments are returned as the model wrote them (the raw JSON text of the value: a streamed call's
argument fragments join to exactly the unstreamed ``arguments``); a value written as a JSON string
holding JSON is unwrapped. ``scan`` is monotone: what it reports as content or as a call's argument
text for a prefix of the output stays a prefix of what it reports for any longer output, so a stream
sends only differences and never takes text back. Text that may be the start of a call marker is held
back until decided (``final`` releases it).

``constraint`` builds an xgrammar structural tag (``StructuredOutput.structural_tag``): under
``required`` or a named function the output is one or more calls (one with ``parallel_tool_calls:
false``) whose arguments follow each function's JSON schema; under ``auto`` text is free until the
format's trigger (``<tool_call>``, ``[TOOL_CALLS]``; for Llama 3 JSON a call's opening text
``{"name": "``), and from the trigger on the call is constrained.
A marker that is a special token of the vocabulary cannot be forced as text: ``auto`` then stays
unconstrained for that format (Llama 3 JSON aside: its trigger is text), and forced calls are written without it (``scan(forced=True)`` reads a
call region from the first character).

Also here: the tools and calls as templates see them (``template_tools``, ``template_messages``, and
``fallback_messages`` for templates without tool support), and ``CallStream``, which turns scans of a
growing output into the pieces a stream sends.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

MAX_TOOLS = 128                    # functions one request may offer
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")      # OpenAI's rule for function names
_WS = " \t\r\n"
_DECODER = json.JSONDecoder()
MAX_WHITESPACE = 1                 # consecutive whitespace characters inside forced arguments


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                 # JSON text
    id: str = field(default_factory=lambda: new_call_id())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class PartialCall:
    """A call as far as the text shows it: ``name`` once its string is complete; ``arguments`` the
    argument text decided so far; ``done`` once the call's closing text was read."""

    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class Scan:
    content: str                       # text outside calls, decided
    calls: list[PartialCall]
    malformed: bool = False            # a call region that does not parse (final: read as content)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _held(tail: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``tail`` may begin one of ``markers``."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(tail)), longest, -1):
            if marker.startswith(tail[-k:]):
                longest = k
                break
    return longest


_NAME_KEYS = ("name",)
_ARG_KEYS = ("arguments", "parameters")


def scan_call_object(text: str, i: int) -> tuple[PartialCall | None, int]:
    """The call object starting at ``text[i]`` (after whitespace): (call, index after it); the call
    is not ``done`` while the object is incomplete; None when the text there is no call object."""
    i = _skip_ws(text, i)
    call = PartialCall()
    if i == len(text):
        return call, i
    if text[i] != "{":
        return None, i
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i == len(text):
            return call, i
        if text[i] == "}":
            call.done = call.name is not None
            return (call if call.done else None), i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return None, i
        try:
            key, j = _DECODER.raw_decode(text, i)
        except ValueError:
            return call, len(text)           # the key is still being written
        j = _skip_ws(text, j)
        if j == len(text):
            return call, j
        if text[j] != ":":
            return None, j
        start = _skip_ws(text, j + 1)
        if start == len(text):
            return call, start
        try:
            value, end = _DECODER.raw_decode(text, start)
        except ValueError:
            if key in _ARG_KEYS and text[start] in "{[":
                call.arguments = text[start:]          # incomplete: everything so far is the value's
            if key in _NAME_KEYS and text[start] != '"':
                return None, start
            return call, len(text)
        if key in _NAME_KEYS:
            if not isinstance(value, str):
                return None, start
            call.name = value
        elif key in _ARG_KEYS:
            call.arguments = value if isinstance(value, str) else text[start:end]
        if end == len(text) and key in _ARG_KEYS and not isinstance(value, str) and text[start] not in "{[":
            return call, end                 # a number may go on
        i = end


class CallFormat:
    """One family's call syntax (subclasses)."""

    name: ClassVar[str]
    marker: ClassVar[str]                            # opens the call region ('' for none)
    marker_needed: ClassVar[bool] = True             # calls are only found after the marker (unforced)
    calls_lead: ClassVar[bool] = False               # calls only at the output's start (else after any text)
    template_signs: ClassVar[tuple[str, ...]]        # text whose presence in a template names this format

    @classmethod
    def detects(cls, template: str) -> bool:
        return any(sign in template for sign in cls.template_signs)

    def scan(self, text: str, *, final: bool, forced: bool = False) -> Scan:
        raise NotImplementedError

    def parse(self, text: str, *, forced: bool = False) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; a call region that does not parse is content."""
        scan = self.scan(text, final=True, forced=forced)
        if scan.malformed or any(not c.done for c in scan.calls):
            return text, []
        return scan.content, [ToolCall(c.name or "", c.arguments) for c in scan.calls]

    # -- writing a call (structural tags) --

    def call_begin(self, name: str, marker: bool) -> str:
        raise NotImplementedError

    def call_end(self, marker: bool) -> str:
        raise NotImplementedError

    separator: ClassVar[str] = "\n"                  # between forced calls


class Hermes(CallFormat):
    name = "hermes"
    marker = "<tool_call>"
    close = "</tool_call>"
    template_signs = ("<tool_call>",)

    def scan(self, text: str, *, final: bool, forced: bool = False) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        pos = 0
        while True:
            at = text.find(self.marker, pos)
            if at < 0:
                tail = text[pos:]
                keep = len(tail) if final else len(tail) - _held(tail, (self.marker,))
                if not (calls and not tail[:keep].strip()):      # whitespace after calls is no content
                    content.append(tail[:keep])
                return Scan("".join(content), calls)
            if not (calls and not text[pos:at].strip()):
                content.append(text[pos:at])
            call, end = scan_call_object(text, at + len(self.marker))
            if call is None:
                return Scan("".join(content), calls, malformed=True)
            calls.append(call)
            if not call.done:
                return Scan("".join(content), calls)
            close = _skip_ws(text, end)
            if close == len(text) and final:
                return Scan("".join(content), calls)       # the closing tag left out at the end
            if text.startswith(self.close, close):
                pos = close + len(self.close)
                continue
            if self.close.startswith(text[close:]) and not final:
                call.done = False                    # the closing tag is being written
                return Scan("".join(content), calls)
            return Scan("".join(content), calls, malformed=True)

    def call_begin(self, name: str, marker: bool) -> str:
        return f'{self.marker}\n{{"name": {json.dumps(name)}, "arguments": '

    def call_end(self, marker: bool) -> str:
        return "}\n" + self.close


class _CallList(CallFormat):
    """Calls as JSON objects one after another (``list_sep``), from the region's start to the end."""

    list_open: ClassVar[str] = ""
    list_sep: ClassVar[str] = ","
    list_close: ClassVar[str] = ""

    def _region(self, text: str, *, final: bool, forced: bool) -> tuple[str, int | None]:
        """(content before the call region, where the region starts; None: no region yet)."""
        raise NotImplementedError

    def scan(self, text: str, *, final: bool, forced: bool = False) -> Scan:
        content, start = self._region(text, final=final, forced=forced)
        if start is None:
            return Scan(content, [])
        i = _skip_ws(text, start)
        if self.list_open:
            if i == len(text):
                return Scan(content, [])
            if not text.startswith(self.list_open, i):
                return Scan(content, [], malformed=True)
            i += len(self.list_open)
        calls: list[PartialCall] = []
        while True:
            call, end = scan_call_object(text, i)
            if call is None:
                return Scan(content, calls, malformed=True)
            if call.name is None and not call.arguments and not call.done:
                return Scan(content, calls)          # nothing of this call yet
            calls.append(call)
            if not call.done:
                return Scan(content, calls)
            i = _skip_ws(text, end)
            if i == len(text):
                if self.list_close:
                    call.done = False                # the list is still open
                    if final:
                        return Scan(content, calls, malformed=True)
                return Scan(content, calls)
            if text.startswith(self.list_sep, i):
                i += len(self.list_sep)
                continue
            if self.list_close and text.startswith(self.list_close, i):
                rest = text[_skip_ws(text, i + len(self.list_close)):]
                return Scan(content, calls, malformed=bool(rest))
            return Scan(content, calls, malformed=True)


# '{"name": "': what a Llama 3 JSON call's text opens with, the trigger of its calls under tool_choice auto
LLAMA3_TRIGGER_LEN = len('{"name": "')


class Llama3Json(_CallList):
    name = "llama3_json"
    marker = "<|python_tag|>"
    marker_needed = False
    calls_lead = True
    template_signs = ("<|python_tag|>", '"parameters": ')
    list_sep = ";"
    separator = "; "

    def _region(self, text: str, *, final: bool, forced: bool) -> tuple[str, int | None]:
        i = _skip_ws(text, 0)
        if text.startswith(self.marker, i):
            return "", i + len(self.marker)
        rest = text[i:]
        if forced:
            return "", i
        if not final and (not rest or self.marker.startswith(rest)):
            return "", None                              # undecided: held back
        if not rest.startswith("{"):
            return text, None
        # A JSON object is a call when its first key names one ('{"name"'); held until that is clear.
        key = re.match(r'\{\s*"(\w*)("?)', rest)
        if key is None:
            return ("", None) if not final and re.fullmatch(r'\{\s*"?', rest) else (text, None)
        if key.group(2):
            return ("", i) if key.group(1) in ("name", "type") else (text, None)
        if not final and any(k.startswith(key.group(1)) for k in ("name", "type")):
            return "", None
        return text, None

    def call_begin(self, name: str, marker: bool) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": '

    def call_end(self, marker: bool) -> str:
        return "}"


class Mistral(_CallList):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    template_signs = ("[TOOL_CALLS]",)
    list_open = "["
    list_close = "]"
    separator = ", "

    def _region(self, text: str, *, final: bool, forced: bool) -> tuple[str, int | None]:
        at = text.find(self.marker)
        if at >= 0:
            return text[:at], at + len(self.marker)
        if forced:
            return "", 0
        keep = len(text) if final else len(text) - _held(text, (self.marker,))
        return text[:keep], None

    def call_begin(self, name: str, marker: bool) -> str:
        return f'{{"name": {json.dumps(name)}, "arguments": '

    def call_end(self, marker: bool) -> str:
        return "}"


class MistralArgs(CallFormat):
    """Mistral's later tokenizers (v11 on: Mistral Small 3.2, Magistral, Devstral): each call is
    ``[TOOL_CALLS]name[ARGS]{...}``, calls one after another, after optional text."""

    name = "mistral_args"
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    template_signs = ("[ARGS]",)
    separator = ""

    def scan(self, text: str, *, final: bool, forced: bool = False) -> Scan:
        at = text.find(self.marker)
        if at < 0 and not forced:
            keep = len(text) if final else len(text) - _held(text, (self.marker,))
            return Scan(text[:keep], [])
        content, pos = ("", 0) if at < 0 or (forced and at > 0) else (text[:at], at + len(self.marker))
        calls: list[PartialCall] = []
        while True:
            name_end = text.find(self.args_marker, pos)
            if name_end < 0:
                name = text[pos:].strip()
                if final or (name and not NAME.fullmatch(name.split("[", 1)[0])):
                    return Scan(content, calls, malformed=bool(name) or not calls)
                return Scan(content, calls)
            name = text[pos:name_end].strip()
            if not NAME.fullmatch(name):
                return Scan(content, calls, malformed=True)
            call = PartialCall(name)
            calls.append(call)
            start = _skip_ws(text, name_end + len(self.args_marker))
            if start == len(text):
                return Scan(content, calls)
            try:
                value, end = _DECODER.raw_decode(text, start)
            except ValueError:
                if text[start] in "{[":
                    call.arguments = text[start:]
                return Scan(content, calls, malformed=final)
            call.arguments = value if isinstance(value, str) else text[start:end]
            call.done = True
            i = _skip_ws(text, end)
            if text.startswith(self.marker, i):
                pos = i + len(self.marker)
            elif i == len(text) or (not final and self.marker.startswith(text[i:])):
                return Scan(content, calls)                # the end, or the next marker being written
            elif forced:
                pos = i                                  # the next call, its marker left out
            else:
                return Scan(content, calls, malformed=True)

    def call_begin(self, name: str, marker: bool) -> str:
        return (self.marker if marker else "") + name + self.args_marker

    def call_end(self, marker: bool) -> str:
        return ""


FORMATS: Mapping[str, type[CallFormat]] = {f.name: f for f in (Hermes, Llama3Json, Mistral, MistralArgs)}
ALIASES = {"qwen": "hermes", "qwen25": "hermes", "llama3": "llama3_json"}
DEFAULT_FORMAT = "hermes"


def get_format(name: str) -> CallFormat:
    """The format registered as ``name`` (or an alias); ValueError naming the choices."""
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {sorted(FORMATS)}")
    return FORMATS[key]()


def detect_format(template: str | None) -> CallFormat:
    """The format a chat template writes calls in (by the text it contains); ``hermes`` when none is
    recognised, which is also the format of the generic fallback (``fallback_messages``)."""
    if template is not None:
        for fmt in (MistralArgs, Mistral, Hermes, Llama3Json):
            if fmt.detects(template):
                return fmt()
    return FORMATS[DEFAULT_FORMAT]()


def template_supports_tools(template: str) -> bool:
    """Whether a chat template renders ``tools`` itself (it reads the variable)."""
    return re.search(r"\btools\b", template) is not None


# -- the structural tag of a request's calls -------------------------------------------------------


@dataclass(frozen=True)
class Function:
    name: str
    parameters: Mapping[str, Any] | None        # a JSON schema; None: any JSON object


def _tag(fmt: CallFormat, fn: Function, marker: bool) -> dict[str, Any]:
    schema = fn.parameters if fn.parameters is not None else {"type": "object"}
    return {"type": "tag", "begin": fmt.call_begin(fn.name, marker),
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE},
            "end": fmt.call_end(marker)}


def constraint(fmt: CallFormat, functions: Sequence[Function], mode: str, *, parallel: bool,
               marker_is_text: bool, open_reasoning: str | None = None) -> dict[str, Any] | None:
    """The structural tag (JSON-able) for ``mode`` ('auto' or 'required'; a named function is
    'required' over that one function), or None where the output stays unconstrained (auto with a
    format without a textual trigger). ``open_reasoning``: the prompt left a reasoning block open
    that the output must close (its end marker) before the calls."""
    if not functions:
        return None
    if mode == "auto":
        if isinstance(fmt, Llama3Json):
            # its marker is a special token, but every call opens with the same text: the trigger
            trigger = fmt.call_begin("", False)[:LLAMA3_TRIGGER_LEN]
            tags = [_tag(fmt, fn, False) for fn in functions]
        elif not fmt.marker or not marker_is_text:
            return None
        else:
            trigger = fmt.marker
            tags = [_tag(fmt, fn, True) for fn in functions]
        if isinstance(fmt, Mistral):          # one call per trigger: '[TOOL_CALLS][{...}]'
            tags = [{**t, "begin": fmt.marker + "[" + t["begin"], "end": t["end"] + "]"} for t in tags]
        body: dict[str, Any] = {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                                "stop_after_first": not parallel}
    else:
        tags = [_tag(fmt, fn, marker_is_text) for fn in functions]
        calls: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
                                 "at_least_one": True, "stop_after_first": not parallel}
        if isinstance(fmt, Mistral):
            opening = (fmt.marker if marker_is_text else "") + "["
            body = {"type": "sequence", "elements": [{"type": "const_string", "value": opening}, calls,
                                                      {"type": "const_string", "value": "]"}]}
        else:
            body = calls
    if open_reasoning is not None:
        body = {"type": "sequence", "elements": [
            {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": open_reasoning}, body]}
    return {"type": "structural_tag", "format": body}


# -- what templates see ----------------------------------------------------------------------------

_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A request's ``tools`` as every frontend gives them to the template (the server and the router
    must render the same tokens): ``{"type", "function": {name, description, parameters, strict}}``
    in that order, null fields left out; None for no tools or anything that is no list of them."""
    if not isinstance(tools, list) or not tools:
        return None
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping):
            return None
        out.append({"type": tool.get("type"),
                    "function": {k: fn[k] for k in _FUNCTION_FIELDS if fn.get(k) is not None}})
    return out


# -- rendering calls for templates without tool support ------------------------------------------


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` rewritten for a template that knows nothing of tools: the tools described in the
    system message (``hermes`` call syntax asked for), assistant calls written out as ``<tool_call>``
    blocks in the content, tool results as user turns in ``<tool_response>`` blocks."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            blocks = []
            for call in message["tool_calls"]:
                fn = call.get("function", {})
                blocks.append("<tool_call>\n" + json.dumps(
                    {"name": fn.get("name"), "arguments": _arguments_object(fn.get("arguments"))},
                    ensure_ascii=False) + "\n</tool_call>")
            text = message.get("content") or ""
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + "\n".join(blocks)})
        elif role == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"})
        else:
            out.append(message)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        instructions = (
            "# Tools\n\nYou may call one or more of these functions to help with the user's request. "
            "Their signatures, one JSON object a line:\n<tools>\n" + listing + "\n</tools>\n\n"
            "To call a function, answer with a JSON object holding its name and arguments inside "
            "<tool_call></tool_call> tags, one block per call:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>')
        if out and out[0].get("role") == "system":
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": (first + "\n\n" if first else "") + instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a template with tool support: each call's ``arguments`` as an object (the
    templates of the supported families write ``arguments | tojson``), as Hugging Face examples do."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            fixed = []
            for call in calls:
                fn = dict(call.get("function") or {})
                fn["arguments"] = _arguments_object(fn.get("arguments"))
                fixed.append({**call, "function": fn})
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out


# -- streams --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallDelta:
    """One streamed piece of call ``index``: its first piece has ``id`` and ``name``."""

    index: int
    id: str | None
    name: str | None
    arguments: str


class CallStream:
    """Feeds an output's text deltas through ``fmt.scan``; returns the content and call pieces that
    are new. ``calls`` ends as the response's calls (ids as streamed). Content before the first call
    is dropped from the text kept once sent (a format whose calls lead the output passes the rest of
    an output found to be no call straight through), so a long answer costs time linear in its length;
    from the first call on, each piece rescans the calls' text."""

    def __init__(self, fmt: CallFormat, *, forced: bool = False) -> None:
        self.fmt = fmt
        self.forced = forced
        self.text = ""                       # the output from the first character not yet sent as content
        self._content = 0
        self._through = False                # the output is no call: content as it comes
        self._ids: list[str] = []
        self._args: list[int] = []           # argument characters sent, per call
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, *, final: bool = False) -> tuple[str, list[CallDelta]]:
        if self._through:
            return delta, []
        content, out = self._feed(delta, final)
        if not self._ids and not self.forced and not final:
            if self.fmt.calls_lead:
                self._through = bool(self._content)
            else:
                self.text, self._content = self.text[self._content:], 0
        return content, out

    def _feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        self.text += delta
        scan = self.fmt.scan(self.text, final=final, forced=self.forced)
        if final and not self._ids and (scan.malformed or any(not c.done for c in scan.calls)):
            scan = Scan(self.text, [])               # nothing sent as a call: all of it is content
        content = scan.content[self._content:]
        self._content = max(self._content, len(scan.content))
        out: list[CallDelta] = []
        for index, call in enumerate(scan.calls):
            if call.name is None:
                break
            if index == len(self._ids):
                self._ids.append(new_call_id())
                self._args.append(0)
                out.append(CallDelta(index, self._ids[index], call.name, ""))
            fresh = call.arguments[self._args[index]:]
            if fresh:
                out.append(CallDelta(index, None, None, fresh))
                self._args[index] = len(call.arguments)
        if final:
            self.calls = [ToolCall(c.name or "", c.arguments, self._ids[i])
                          for i, c in enumerate(scan.calls[:len(self._ids)])]
        return content, out
