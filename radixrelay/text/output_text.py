"""Per-request output assembly in the frontend: token updates in, text deltas out.

The scheduler releases tokens in order and never a partial stop string; on a stop-string finish it
says how many characters of the emitted text to drop (``RequestUpdate.trim_chars``). Deltas are
therefore final: text once returned by ``apply`` is never taken back, except that the last call
may return less than its tokens spell (the trimmed stop string).
"""

from __future__ import annotations

from radixrelay.outputs import RequestOutput
from radixrelay.protocol.messages import RequestUpdate, TokenUpdate
from radixrelay.protocol.step import TokenLogprobs
from radixrelay.sampling_params import SamplingParams
from radixrelay.text.detokenizer import IncrementalDetokenizer
from radixrelay.text.tokenizer import Tokenizer


class OutputAssembler:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                             context_ids=prompt_ids)
        self._want_logprobs = params.logprobs is not None
        self._want_prompt_logprobs = params.prompt_logprobs is not None
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs | None] = [None]   # token 0 has none
        self.text = ""
        self.last: RequestUpdate | None = None   # the newest update (counts, finish reason)

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def apply(self, item: TokenUpdate) -> str:
        """Fold one update in; returns the text it adds."""
        update = item.update
        self.last = update
        self.token_ids.extend(update.token_ids)
        if item.logprobs:
            self.logprobs.extend(item.logprobs)
        if item.prompt_logprobs:
            self.prompt_logprobs.extend(item.prompt_logprobs)
        delta = self._detok.add(update.token_ids)
        if update.finished:
            delta += self._detok.finish()
            if update.trim_chars:
                full = self.text + delta
                delta = full[len(self.text): max(len(self.text), len(full) - update.trim_chars)]
        self.text += delta
        return delta

    def result(self) -> RequestOutput:
        update = self.last
        if update is None or not update.finished:
            raise RuntimeError("result() before the request finished")
        return RequestOutput(self.text, list(self.token_ids), update.finish_reason or "abort",
                             update.prompt_tokens, update.cached_tokens, update.completion_tokens,
                             list(self.logprobs) if self._want_logprobs else None,
                             list(self.prompt_logprobs) if self._want_prompt_logprobs else None,
                             update.error, update.module_tokens)
