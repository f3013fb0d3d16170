"""OpenAI-compatible request and response bodies (msgspec structs) and their validation.

Requests are decoded strictly typed (a wrong type or an out-of-range value is a 400 naming the
field). No silent ignores: every OpenAI request field this server does not implement is listed in
``UNSUPPORTED`` and refused with a 400 naming it, unless it holds a value that changes nothing
(``functions: []``, ``store: false``, ...); the same holds for the well-known
extension fields of other servers (vLLM, SGLang) that change the output (``guided_json``,
``min_new_tokens``, ...). Any other unknown field is ignored, as OpenAI's own clients send fields a
server may have no use for. ``APIError`` carries the HTTP status and OpenAI's error JSON.
Extensions beyond OpenAI's API: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``cache_salt``, ``prompt_schema`` (the prompt is written
against a schema registered with POST /v1/schemas: modular prompt reuse, ``radixrelay.modules``),
and for chat the vLLM/SGLang fields ``chat_template_kwargs`` and ``separate_reasoning``. Tools
(``ToolRequest``) are checked here; reading calls and reasoning out of outputs is
``radixrelay.text.chat_output``'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec
import numpy as np
from msgspec import Meta

from radixrelay.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams, stop_strings_problem
from radixrelay.structured.spec import InvalidStructuredOutput, StructuredOutput, check_schema
from radixrelay.text.json_ids import PLACEHOLDER, plain_ids, split_prompt
from radixrelay.text.tool_calls import MAX_TOOLS, NAME, Function, template_tools

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


def decode_request(body: bytes, kind: type[GenerationRequest], split_ids: bool = True) -> Any:
    """JSON body -> ``kind``; malformed JSON, wrong types, out-of-range values and unsupported
    fields -> 400 naming the field. The body is parsed once (``_wire``): the values of unsupported
    fields and a completion's ``prompt`` are kept raw while the typed fields are decoded, then
    checked (``refuse_unsupported``) and decoded by type (``decode_prompt``)."""
    wire = _WIRE[kind]
    try:
        if not body.isascii():
            body.decode()            # UTF-8 throughout, the keys and values the decode skips included
        # A flat token-id prompt is cut out first (``split_prompt``): no decoder scans its ids.
        split = split_prompt(body) if split_ids and "prompt" in kind.__struct_fields__ else None
        if split is not None:
            try:
                req = msgspec.json.decode(split[0], type=wire)
            except (msgspec.DecodeError, msgspec.ValidationError):
                # anything else (an integral float to read as its integer, an error whose message must
                # give offsets in the body as sent): the body decoded whole
                return decode_request(body, kind, split_ids=False)
        else:
            try:
                req = msgspec.json.decode(body, type=wire)
            except msgspec.ValidationError as exc:
                if "got `float`" not in str(exc):
                    raise
                fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])   # top level only
                req = msgspec.json.decode(_integral_floats_as_ints(fields), type=wire)
        refuse_unsupported(req, UNSUPPORTED[kind.endpoint])
        values = {name: getattr(req, name) for name in kind.__struct_fields__}
        if split is not None:
            if bytes(req.prompt) != PLACEHOLDER or req.prompt_schema is not None:
                return decode_request(body, kind, split_ids=False)    # the ids were not the prompt's
            values["prompt"] = split[1]
        elif "prompt" in values:
            values["prompt"] = decode_prompt(values["prompt"], schema=req.prompt_schema is not None)
        return kind(**values)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        raise invalid(f"invalid request: {exc}", match.group(1) if match else None) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        raise invalid("request body is not valid UTF-8") from None
    except RecursionError:
        # msgspec decodes nested arrays/objects recursively: a body nested thousands deep ends here.
        raise invalid("request body is nested too deeply") from None


T = TypeVar("T")


def decode_body(body: bytes, kind: type[T]) -> T:
    """A JSON body as ``kind`` (a msgspec struct) for the endpoints besides generation; malformed JSON,
    deep nesting and wrong or unknown fields are 400s naming the field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        raise invalid(f"invalid request: {exc}", match.group(1) if match else None) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid("request body is nested too deeply") from None


# Integer fields: JSON Schema counts 4.0 as an integer, and OpenAI's own API and vLLM accept it, so
# an integral float is read as that integer. Only these fields are touched (``messages`` reach the
# chat template exactly as sent), and only when the strict decode failed on a float, so a
# well-formed body is decoded once. The token ids of ``prompt`` follow the same rule, in numpy
# (``decode_prompt``, ``radixrelay.admission.checked_ids``).
_INT_FIELDS = frozenset({"n", "max_tokens", "max_completion_tokens", "top_k", "seed", "logprobs",
                         "top_logprobs", "stop_token_ids", "min_tokens"})


def _integral_floats_as_ints(fields: dict[str, msgspec.Raw]) -> bytes:
    def fix(value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, list):
            return [fix(v) for v in value]
        return value

    fixed = {k: msgspec.Raw(msgspec.json.encode(fix(msgspec.json.decode(v))))
             if k in _INT_FIELDS else v for k, v in fields.items()}
    return msgspec.json.encode(fixed)


# -- fields this server does not implement ------------------------------------------------------

Endpoint = Literal["chat", "completions"]
_NULL: dict[str, Any] = {"type": "null"}


@dataclass(frozen=True)
class Unsupported:
    """A request field this server does not implement. ``accepts(value)`` is true for the values
    that change nothing (always ``null``; e.g. ``[]`` for ``tools``), which pass; anything else is a
    400 naming the field. ``schema`` is the JSON schema of the accepted values (for /openapi.json)."""

    name: str
    accepts: Callable[[Any], bool]
    schema: dict[str, Any]
    why: str = "not supported by this server"


def _only_null(name: str, why: str = "not supported by this server") -> Unsupported:
    return Unsupported(name, lambda v: v is None, _NULL, why)


def _one_of(name: str, *values: Any, why: str = "not supported by this server") -> Unsupported:
    """Accepts null and exactly ``values`` (compared as JSON: ``False`` is not ``0``)."""
    def accepts(v: Any) -> bool:
        return v is None or any(type(v) is type(x) and v == x for x in values)
    return Unsupported(name, accepts, {"anyOf": [{"enum": list(values)}, _NULL]}, why)


def _empty(name: str, json_type: Literal["array", "object"], why: str) -> Unsupported:
    empty: list[Any] | dict[str, Any] = [] if json_type == "array" else {}
    bound = {"maxItems": 0} if json_type == "array" else {"maxProperties": 0}
    return Unsupported(name, lambda v: v is None or v == empty,
                       {"anyOf": [{"type": json_type, **bound}, _NULL]}, why)


_COMMON: tuple[Unsupported, ...] = (
    # Extension fields of other OpenAI-compatible servers that change the output.
    *(_only_null(name, "not supported by this server; structured outputs are `response_format`, "
                       "`guided_json`, `guided_regex` and `guided_choice`")
      for name in ("guided_grammar", "structured_outputs", "json_schema", "regex", "ebnf")),
    _one_of("guided_decoding_backend", "xgrammar", why="the grammar engine of this server is xgrammar"),
    _only_null("guided_whitespace_pattern", "JSON outputs use compact whitespace"),
    *(_only_null(name) for name in ("min_new_tokens", "bad_words",
                                    "allowed_token_ids", "prompt_logprobs", "truncate_prompt_tokens",
                                    "length_penalty", "logits_processors", "lora_path",
                                    "return_tokens_as_token_ids", "return_hidden_states")),
    _one_of("include_stop_str_in_output", False),
    _one_of("no_stop_trim", False),
    _one_of("use_beam_search", False),
    _one_of("spaces_between_special_tokens", True),
)
_CHAT_ONLY: tuple[Unsupported, ...] = (
    _empty("functions", "array", "the legacy `functions` field is not supported by this server; use `tools`"),
    _one_of("function_call", "none", "auto",
            why="the legacy `function_call` field is not supported by this server; use `tool_choice`"),
    _only_null("audio", "audio output is not supported by this server"),
    Unsupported("modalities", lambda v: v is None or v == ["text"],
                {"anyOf": [{"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1},
                           _NULL]}, "only [\"text\"] is supported"),
    _only_null("prediction", "predicted outputs are not supported by this server"),
    _only_null("web_search_options", "web search is not supported by this server"),
    _one_of("verbosity", "medium"),
    _one_of("service_tier", "auto", "default", why="this server has one service tier"),
    _one_of("store", False, why="this server does not store completions"),
    _one_of("add_generation_prompt", True),
    _one_of("continue_final_message", False),
    _one_of("echo", False),
    *(_only_null(name) for name in ("chat_template", "documents", "best_of")),
)
_COMPLETIONS_ONLY: tuple[Unsupported, ...] = (
    _one_of("suffix", "", why="suffix (insertion) is not supported by this server"),
    _one_of("best_of", 1, why="best_of > 1 is not supported by this server; use n"),
)
UNSUPPORTED: Mapping[Endpoint, Mapping[str, Unsupported]] = {
    "chat": {u.name: u for u in (*_COMMON, *_CHAT_ONLY)},
    "completions": {u.name: u for u in (*_COMMON, *_COMPLETIONS_ONLY)},
}


def refuse_unsupported(req: msgspec.Struct, table: Mapping[str, Unsupported]) -> None:
    """400 for the first field of ``table`` whose raw value in ``req`` (a ``_wire`` struct; ``null``
    when absent) does something."""
    for name, unsupported in table.items():
        if not unsupported.accepts(msgspec.json.decode(getattr(req, name))):
            raise invalid(f"unsupported value for `{name}`: {unsupported.why}", name)


# -- requests ---------------------------------------------------------------------------------

# Ranges enforced while decoding (and published in /openapi.json). Limits that depend on the
# served model (n <= --max-n, max_tokens within the context, token ids < vocabulary) are checked
# in serving.py and patched into the schema by openapi_schema.py.
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
NonNegative = Annotated[float, Meta(ge=0)]
Probability = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
TokenId = Annotated[int, Meta(ge=0)]


class JSONSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None       # schemas are always compiled strictly (no properties beyond them)


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def structured_output(self) -> StructuredOutput:
        if self.type == "json_object":
            return StructuredOutput.json_object()
        if self.json_schema is None or self.json_schema.schema is None:
            raise InvalidStructuredOutput('type "json_schema" needs json_schema.schema')
        return StructuredOutput.json_schema(self.json_schema.schema)


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None     # accepted; no effect (no obfuscation padding)


class GenerationRequest(msgspec.Struct, kw_only=True):
    endpoint: ClassVar[Endpoint]
    model: str
    n: Annotated[int, Meta(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=0)] | None = None
    temperature: NonNegative | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**63 - 1)] | None = None
    min_p: Probability | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    # OpenAI's: token id (a decimal string) -> bias added to its logit, in [-100, 100]
    logit_bias: Annotated[dict[str, Annotated[float, Meta(ge=-100, le=100)]],
                          Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None   # vLLM's: EOS and stop_token_ids held back until then
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    # Modular prompt reuse: the name of a registered schema. Completions: ``prompt`` is PML
    # (``<prompt schema=...>``) or its JSON form; chat: message contents are PML fragments.
    prompt_schema: str | None = None
    # Structured outputs: OpenAI's ``response_format`` and vLLM's ``guided_*`` extensions (one at a time).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # Accepted, no effect on the output: identifiers and tags for the caller's own bookkeeping, and a
    # cache-routing hint (this server finds shared prefixes by itself).
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    # Pinned prefixes: "24h" pins the whole prompt (``prompt_pins``); "in_memory" (the default) is the
    # radix cache as always. ``priority``: smaller first (vLLM's field), only on a server started with
    # --enable-priority (the scheduler refuses it otherwise).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    priority: Int64 = 0

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def structured_field(self) -> str | None:
        """The field that holds the request's output constraint (for errors), if any."""
        return next(iter(self._structured_given()), None)

    def _structured_given(self) -> dict[str, Any]:
        return {name: value for name, value in (("response_format", self.response_format),
                                                ("guided_json", self.guided_json),
                                                ("guided_regex", self.guided_regex),
                                                ("guided_choice", self.guided_choice))
                if value is not None and not (isinstance(value, ResponseFormat) and value.type == "text")}

    def structured_output(self) -> StructuredOutput | None:
        """The request's output constraint, or None; 400 for two at once or an unusable one."""
        given = self._structured_given()
        if len(given) > 1:
            raise invalid(f"at most one structured output per request, got {', '.join(given)}", list(given)[1])
        if not given:
            return None
        (name, value), = given.items()
        try:
            if isinstance(value, ResponseFormat):
                return value.structured_output()
            if name == "guided_json":
                return StructuredOutput.json_schema(value)
            if name == "guided_regex":
                return StructuredOutput.regex(value)
            return StructuredOutput.choice(value)
        except (ValueError, RecursionError) as exc:   # InvalidStructuredOutput; json.dumps of a deep dict
            raise invalid(f"{name}: {exc}", name) from None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stops):
            raise invalid("stop strings must be non-empty", "stop")
        if problem := stop_strings_problem(stops):
            raise invalid(problem, "stop")
        return stops


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: Annotated[str, Meta(pattern=NAME.pattern.join("^$"))]
    description: str | None = None
    parameters: dict[str, Any] | None = None      # a JSON schema (absent: any JSON object)
    strict: bool | None = None                    # arguments always follow ``parameters`` when forced


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionName


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# Variables the server gives every chat template itself (and ``self``, which Jinja reserves):
# ``chat_template_kwargs`` may not set them.
RESERVED_TEMPLATE_VARS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "self")


def template_kwargs(given: dict[str, Any] | None, reasoning_effort: str | None = None) -> dict[str, Any]:
    """Extra chat template variables: ``chat_template_kwargs`` (a 400 for a reserved name), then
    ``reasoning_effort`` if given."""
    extra = dict(given or {})
    if clash := [k for k in RESERVED_TEMPLATE_VARS if k in extra]:
        raise invalid(f"chat_template_kwargs may not set {', '.join(clash)} (reserved: "
                      f"{', '.join(RESERVED_TEMPLATE_VARS)})", "chat_template_kwargs")
    if reasoning_effort is not None:
        extra.setdefault("reasoning_effort", reasoning_effort)
    return extra


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, checked: ``mode`` is ``none`` (no tools, or calls not wanted: the
    template still sees the tools), ``auto``, or ``required`` over ``functions`` (a named function:
    that one)."""

    tools: list[dict[str, Any]]              # as the template sees them
    functions: list[Function]                # the ones that may be called
    mode: Literal["none", "auto", "required"]
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.mode == "required"


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    endpoint: ClassVar[Endpoint] = "chat"
    # Decoded untyped so that templates see every key a message has (name, tool_calls, ...);
    # chat_template.validate_messages checks roles and content. Schema: ``MessageParam``.
    messages: list[dict[str, Any]]
    max_completion_tokens: Annotated[int, Meta(ge=0)] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None     # extra variables for the chat template
    reasoning_effort: ReasoningEffort | None = None        # given to the template as ``reasoning_effort``
    separate_reasoning: bool = True                        # reasoning in ``reasoning_content`` (SGLang's field)

    def template_kwargs(self) -> dict[str, Any]:
        """Extra template variables: ``chat_template_kwargs``, then ``reasoning_effort`` if given."""
        return template_kwargs(self.chat_template_kwargs, self.reasoning_effort)

    def tool_request(self) -> ToolRequest:
        """The request's tools, checked (400s naming ``tools`` or ``tool_choice``)."""
        tools = self.tools or []
        if len(tools) > MAX_TOOLS:
            raise invalid(f"at most {MAX_TOOLS} tools per request, got {len(tools)}", "tools")
        functions: list[Function] = []
        for i, tool in enumerate(tools):
            fn = tool.function
            if not NAME.fullmatch(fn.name):
                raise invalid(f"tools[{i}].function.name: {fn.name!r} is not a valid function name (1 to 64 "
                              "letters, digits, '_' or '-')", "tools")
            if any(f.name == fn.name for f in functions):
                raise invalid(f"tools[{i}].function.name: {fn.name!r} is defined twice", "tools")
            if fn.parameters is not None:
                try:
                    check_schema(fn.parameters)
                except InvalidStructuredOutput as exc:
                    raise invalid(f"tools[{i}].function.parameters: {exc}", "tools") from None
                except RecursionError:
                    raise invalid(f"tools[{i}].function.parameters: nested too deeply", "tools") from None
            functions.append(Function(fn.name, fn.parameters))
        choice = self.tool_choice
        parallel = self.parallel_tool_calls is not False
        dicts = template_tools(msgspec.to_builtins(tools)) or []
        if isinstance(choice, NamedToolChoice):
            named = [f for f in functions if f.name == choice.function.name]
            if not named:
                raise invalid(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                              "tool_choice")
            return ToolRequest(dicts, named, "required", False)
        if choice == "required" and not functions:
            raise invalid('tool_choice "required" needs at least one tool in tools', "tool_choice")
        mode: Literal["none", "auto", "required"] = choice or ("auto" if functions else "none")
        if not functions:
            mode = "none"
        return ToolRequest(dicts, functions, mode, parallel)

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest, kw_only=True):
    endpoint: ClassVar[Endpoint] = "completions"
    # A string, token ids, or a list of either (``completion_prompts``); with ``prompt_schema``, PML
    # text or a JSON object prompt, or a list of them (``schema_prompts``). As ``decode_request``
    # leaves it: token ids are a numpy array each (``decode_prompt``), never a Python int per id.
    prompt: str | list[Any] | dict[str, Any]
    logprobs: TopLogprobs | None = None
    echo: bool = False


class TextPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]
    text: str


class MessageToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"]
    function: FunctionCall       # arguments: JSON text (other text reaches the template as it is)


class MessageParam(msgspec.Struct, kw_only=True):
    """One chat message as published in /openapi.json (requests decode messages as plain objects:
    other keys pass to the chat template). ``content`` may be null only for an assistant turn;
    a tool turn needs ``tool_call_id``; only an assistant turn has ``tool_calls``."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None


def _wire(kind: type[GenerationRequest]) -> type[msgspec.Struct]:
    """``kind`` as ``decode_request`` parses a body: the values of the endpoint's unsupported fields
    (``null`` when absent) and a completion's ``prompt`` kept raw."""
    table = UNSUPPORTED[kind.endpoint]
    if clash := set(table) & set(kind.__struct_fields__):
        raise TypeError(f"{kind.__name__}: unsupported fields that are fields: {sorted(clash)}")
    raw: list[tuple[str, type, msgspec.Raw] | tuple[str, type]] = [
        (name, msgspec.Raw, msgspec.Raw(b"null")) for name in table]
    if "prompt" in kind.__struct_fields__:
        raw.append(("prompt", msgspec.Raw))
    return msgspec.defstruct(f"{kind.__name__}Wire", raw, bases=(kind,), kw_only=True)


_WIRE: Mapping[type[GenerationRequest], type[msgspec.Struct]] = {
    kind: _wire(kind) for kind in (ChatCompletionRequest, CompletionRequest)}


def completion_prompts(req: CompletionRequest) -> list[str | np.ndarray]:
    """``prompt`` (as ``decode_request`` left it) as a list of prompts: texts, or token ids as numpy
    arrays (checked by ``radixrelay.admission.checked_ids``)."""
    prompt = req.prompt
    if isinstance(prompt, dict):
        raise invalid("prompt: a JSON object prompt needs `prompt_schema` (modular prompt reuse)", "prompt")
    if isinstance(prompt, (str, np.ndarray)):
        return [prompt]
    if prompt and all(isinstance(p, (str, np.ndarray)) for p in prompt):
        return list(prompt)
    raise invalid(_NOT_A_PROMPT, "prompt")


def schema_prompts(req: CompletionRequest) -> list[str | dict[str, Any]]:
    """``prompt`` of a request with ``prompt_schema`` as a list of prompts: PML text (``<prompt
    schema=...>``), a JSON object prompt, or a non-empty list of either."""
    prompt = req.prompt
    if isinstance(prompt, (str, dict)):
        return [prompt]
    if prompt and all(isinstance(p, (str, dict)) for p in prompt):
        return list(prompt)
    raise invalid("with prompt_schema, prompt must be PML text, a JSON object prompt, or a non-empty "
                  "list of them (not token ids)", "prompt")


_NOT_A_PROMPT = "prompt must be a string, a list of token ids, or a non-empty list of either"
_ANY_PROMPT = msgspec.json.Decoder(str | list[Any] | dict[str, Any])
_TEXT = msgspec.json.Decoder(str)
_TEXTS = msgspec.json.Decoder(list[str])
_IDS = msgspec.json.Decoder(list[int])
_NUMBERS = msgspec.json.Decoder(list[int | float])
_ID_LISTS = msgspec.json.Decoder(list[list[int]])
_NUMBER_LISTS = msgspec.json.Decoder(list[list[int | float]])
_OPENING = re.compile(rb"\s*([\[{\"]?)\s*(.?)", re.S)    # the first character, and the next one's


def decode_prompt(raw: msgspec.Raw, *, schema: bool) -> Any:
    """A completion's raw ``prompt``: with ``prompt_schema`` as JSON has it (``schema_prompts``); else
    a string, a list of strings, token ids as one numpy array (int64, or float64 where the JSON has a
    float: ``checked_ids`` takes integral ones), or a list of such arrays, each decoded at C speed by
    its type (the first characters tell which); a dict is left for ``completion_prompts`` to refuse."""
    try:
        if schema:
            return _ANY_PROMPT.decode(raw)
        opening = _OPENING.match(memoryview(raw))
        first, second = (opening[1], opening[2]) if opening else (b"", b"")
        if first == b'"':
            return _TEXT.decode(raw)
        if first == b"{":
            return _ANY_PROMPT.decode(raw)
        if first == b"[" and second == b'"':
            return _TEXTS.decode(raw)
        if first == b"[" and second == b"[":
            try:
                return [_id_array(ids) for ids in _ID_LISTS.decode(raw)]
            except msgspec.ValidationError as exc:
                if "got `float`" not in str(exc):
                    raise
                return [_id_array(ids, floats=True) for ids in _NUMBER_LISTS.decode(raw)]
        if first == b"[" and second and second in b"-0123456789":
            if (ids := plain_ids(raw)) is not None:
                return ids
            try:
                return _id_array(_IDS.decode(raw))
            except msgspec.ValidationError as exc:
                if "got `float`" not in str(exc):
                    raise
                return _id_array(_NUMBERS.decode(raw), floats=True)
    except msgspec.ValidationError as exc:
        raise invalid(f"{_NOT_A_PROMPT}: {str(exc).replace('at `$', 'at `$.prompt')}", "prompt") from None
    raise invalid(_NOT_A_PROMPT, "prompt")


def _id_array(values: list[int] | list[int | float], floats: bool = False) -> np.ndarray:
    """Decoded token ids as [n] int64 (float64 with ``floats``); values past those are kept as objects
    (out of any vocabulary: ``checked_ids`` refuses them)."""
    try:
        if floats:
            return np.array(values, dtype=np.float64)
        return np.fromiter(values, dtype=np.int64, count=len(values))
    except OverflowError:
        return np.array(values, dtype=object)


_TOKEN_KEY = re.compile(r"0|[1-9][0-9]{0,18}")


def logit_bias_pairs(bias: Mapping[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` object as (token id, bias) pairs; a key that is not a token id -> 400."""
    pairs = []
    for key, value in bias.items():
        if not _TOKEN_KEY.fullmatch(key):
            raise invalid(f"logit_bias keys must be token ids written as decimal integers, got {key!r}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def sampling_params(req: GenerationRequest, *, max_tokens: int, logprobs: int | None,
                    seed: int | None, prompt_logprobs: int | None = None,
                    overrides: Mapping[str, Any] | None = None) -> SamplingParams:
    """The request's sampling fields as ``SamplingParams``; out-of-range values -> 400.
    ``overrides``: fields the server sets for the request (a tool call's constraint)."""
    fields: dict[str, Any] = {
        "max_tokens": max_tokens, "seed": seed, "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs, "stop": req.stop_strings(),
        "stop_token_ids": tuple(req.stop_token_ids or ()), "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens, "structured": req.structured_output(),
        **(overrides or {}),
    }
    optional = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                "min_p": req.min_p, "presence_penalty": req.presence_penalty,
                "frequency_penalty": req.frequency_penalty,
                "repetition_penalty": req.repetition_penalty}
    fields.update((k, v) for k, v in optional.items() if v is not None)
    if req.logit_bias:
        fields["logit_bias"] = logit_bias_pairs(req.logit_bias)
    if req.min_tokens:
        fields["min_tokens"] = req.min_tokens
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        match = re.match(r"SamplingParams\.(\w+)", str(exc))
        param = match.group(1) if match else None
        if param in ("logprobs", "prompt_logprobs"):
            param = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
        raise invalid(str(exc).removeprefix("SamplingParams."), param) from None


# -- responses --------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int
    module_tokens: int = 0          # served from prompt modules' KV (``prompt_schema``)
    module_padding_tokens: int = 0  # placeholders padding module spans to whole pages (in prompt_tokens)


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


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str               # JSON text


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None                              # null: the message only calls tools
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None             # a reasoning model's thinking, apart from content


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


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A piece of call ``index``: its first piece has ``id``, ``type`` and the name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """``APIError.body()``: every error this server answers with (/openapi.json)."""

    error: ErrorDetail


class Health(msgspec.Struct):
    """GET /health: ``ok`` (200); ``draining`` or ``unavailable`` (503)."""

    status: Literal["ok", "draining", "unavailable"]


class Flushed(msgspec.Struct):
    flushed: bool
