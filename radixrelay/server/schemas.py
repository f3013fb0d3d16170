"""/v1/schemas: register, list, show and delete the PML schemas of modular prompt reuse.

The routes are kept out of /openapi.json (like the ``prompt_schema`` values other than null): what
they accept depends on what is registered, which a static schema cannot say. Bodies and errors
follow the OpenAI conventions of the other endpoints: a ``SchemaError`` is a 400 naming ``schema``,
an unknown name a 404 ``schema_not_found``.
"""

from __future__ import annotations

import msgspec

from radixrelay.modules.layout import layout
from radixrelay.modules.pml import SchemaError, param_positions, parse_schema
from radixrelay.modules.registry import SchemaInfo, SchemaRegistry, UnknownSchemaError
from radixrelay.server import openai_protocol as oa


class SchemaCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/schemas: the PML document; ``model`` (optional) must be the served model."""

    schema: str
    model: str | None = None


class SchemaList(msgspec.Struct):
    data: list[SchemaInfo]
    object: str = "list"


class SchemaDeleted(msgspec.Struct):
    name: str
    deleted: bool = True
    object: str = "schema.deleted"


def not_found(exc: UnknownSchemaError) -> oa.APIError:
    return oa.APIError(404, str(exc), param="name", code="schema_not_found")


def register(registry: SchemaRegistry, model_name: str, body: bytes, max_context: int | None = None) -> SchemaInfo:
    """Decode the body and register its schema; APIError 400 for a bad body, another model's
    schema, invalid PML, or (given the model's ``max_context``) a schema whose positions run past
    the context: its modules could never be used (CPU work: the caller runs it off the event loop)."""
    try:
        req = msgspec.json.decode(body, type=SchemaCreate)
    except msgspec.ValidationError as exc:
        raise oa.invalid(f"invalid request: {exc}", "schema") from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise oa.invalid(f"request body is not valid JSON: {exc}") from None
    if req.model is not None and req.model != model_name:
        raise oa.invalid(f"the schema is for model {req.model!r}; this server serves {model_name!r}", "model")
    try:
        if max_context is None:
            return registry.register(req.schema)
        schema = parse_schema(req.schema, registry.limits)
        # Params alone bound the positions from below: refused before any text is tokenized.
        if (low := param_positions(schema.children)) > max_context:
            raise SchemaError(f"schema {schema.name!r}: its params take {low} positions, more than the "
                              f"model's context of {max_context}")
        lay = layout(schema, registry.encode, placeholder_id=registry.placeholder_id,
                     role_text=registry.role_text, limits=registry.limits)
        if lay.end > max_context:
            raise SchemaError(f"schema {schema.name!r}: it ends at position {lay.end}, past the model's "
                              f"context of {max_context}")
        return registry.register(schema)
    except SchemaError as exc:
        raise oa.invalid(str(exc), "schema") from None


def get(registry: SchemaRegistry, name: str) -> SchemaInfo:
    try:
        return registry.get(name)
    except UnknownSchemaError as exc:
        raise not_found(exc) from None


def delete(registry: SchemaRegistry, name: str) -> SchemaDeleted:
    if not registry.delete(name):
        raise not_found(UnknownSchemaError(name))
    return SchemaDeleted(name)


def listing(registry: SchemaRegistry) -> SchemaList:
    return SchemaList(registry.list())
