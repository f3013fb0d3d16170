"""Structured outputs are compiled by the server before a request is queued, so a constraint the
grammar engine refuses is a 400 with its message, and one too costly to compile (past
``COMPILE_TIMEOUT_S``) a 400 too, instead of a stall in the worker. Compiles run in threads (the
engine releases the GIL) and are cached; the worker compiles again from its own cache."""

from __future__ import annotations

import asyncio

from radixrelay.structured.grammar import GrammarEngine
from radixrelay.structured.spec import InvalidStructuredOutput, StructuredOutput
from radixrelay.text.tokenizer import Tokenizer

COMPILE_TIMEOUT_S = 10.0


class GrammarCheck:
    def __init__(self, tokenizer: Tokenizer, timeout: float = COMPILE_TIMEOUT_S) -> None:
        self._tokenizer = tokenizer
        self.timeout = timeout
        self._engine: GrammarEngine | None = None
        self._lock = asyncio.Lock()

    async def check(self, spec: StructuredOutput) -> None:
        """Raise ``InvalidStructuredOutput`` unless ``spec`` compiles within the timeout."""
        engine = await self._get_engine()
        try:
            await asyncio.wait_for(asyncio.to_thread(engine.compile, spec), self.timeout)
        except TimeoutError:
            raise InvalidStructuredOutput(f"{spec.kind}: not compiled within {self.timeout:g} s; "
                                          "simplify the constraint") from None

    async def _get_engine(self) -> GrammarEngine:
        async with self._lock:       # the first structured request builds it (imports xgrammar: seconds)
            if self._engine is None:
                self._engine = await asyncio.to_thread(GrammarEngine, self._tokenizer)
            return self._engine
