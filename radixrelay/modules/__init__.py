"""Modular prompt reuse (Prompt Cache, opt-in): the PML schema language, a Python builder for it, and
the position-ID layout of schemas and prompts. Pure Python; nothing here imports torch.

    pml.py      AST, parser (defusedxml), validation, prompt checks, JSON form, serializers
    builder.py  schema(...), module(...), ... : the same AST from Python, same validator
    layout.py   layout(schema, encode, placeholder_id=...) -> SchemaLayout; .prompt_plan(prompt, encode)
"""

from .layout import (
    ModuleLayout,
    ModuleSegment,
    ParamSegment,
    PromptPlan,
    SchemaLayout,
    Segment,
    TextSegment,
    layout,
)
from .pml import (
    ROLES,
    Import,
    Limits,
    Module,
    ModuleInfo,
    Node,
    Param,
    Prompt,
    PromptNode,
    Role,
    Scaffold,
    Schema,
    SchemaError,
    Text,
    Union,
    check_imports,
    check_prompt,
    merge_text,
    module_index,
    parse_schema,
    prompt_from_json,
    prompt_from_str,
    prompt_to_json,
    prompt_to_pml,
    to_pml,
    validate,
    validate_prompt,
)

__all__ = [
    "ROLES", "Import", "Limits", "Module", "ModuleInfo", "Node", "Param", "Prompt", "PromptNode", "Role",
    "Scaffold", "Schema", "SchemaError", "Text", "Union", "check_imports", "check_prompt", "merge_text", "module_index",
    "parse_schema", "prompt_from_json", "prompt_from_str", "prompt_to_json", "prompt_to_pml", "to_pml",
    "validate", "validate_prompt",
    "ModuleLayout", "ModuleSegment", "ParamSegment", "PromptPlan", "SchemaLayout", "Segment", "TextSegment",
    "layout",
]
