"""Structured outputs: constraints on what a request may generate (a JSON schema, any JSON object, a
regular expression, a choice among strings), compiled to token-level grammars by xgrammar.

``spec`` holds the constraint as it crosses process boundaries (inside ``SamplingParams``);
``grammar`` compiles it against a tokenizer's vocabulary (frontends compile to refuse bad
constraints with the engine's message; the worker compiles again, cached, to mask logits).
"""

from radixrelay.structured.spec import InvalidStructuredOutput, StructuredOutput

__all__ = ["InvalidStructuredOutput", "StructuredOutput"]
