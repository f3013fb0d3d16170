"""Stop conditions for one sampled token: stop token ids, EOS, stop strings, max_tokens.

Stop strings are matched on text from the injected ``detokenize``, over a tail window only: the
tokens not yet emitted plus ``max_stop_chars + 1`` tokens before them (every token spells at
least one character, so a stop string that ends in the newest token starts inside the window).
Tokens whose text ends with a proper prefix of a stop string are held back, so no partial stop
string ever reaches the caller; they are released once the text moves on, or when the request
ends otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixrelay.scheduler.request import FinishReason, Request

Detokenize = Callable[[list[int]], str]


@dataclass(frozen=True)
class StopDecision:
    emit_upto: int                    # outputs [num_emitted, emit_upto) may go to the caller now
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    trim_chars: int = 0               # characters to drop from the end of the emitted text


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], detokenize: Detokenize | None) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize

    def on_token(self, req: Request) -> StopDecision:
        """Decide after ``req.token_ids[-1]`` was appended."""
        sp = req.sampling
        token = req.token_ids[-1]
        n_out = req.num_outputs
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            return StopDecision(n_out - 1, "stop", token)
        emit_upto = n_out
        if sp.stop:
            decision = self._stop_strings(req)
            if decision.finish_reason is not None:
                return decision
            emit_upto = decision.emit_upto
        if n_out >= sp.max_tokens:
            return StopDecision(n_out, "length")
        return StopDecision(emit_upto)

    def _stop_strings(self, req: Request) -> StopDecision:
        assert self.detokenize is not None  # Scheduler.add_request refuses stop strings without
        stops = req.sampling.stop
        n_out = req.num_outputs
        pending = n_out - req.num_emitted
        # One extra token in front: decoders may alter a window's first token (a sentencepiece
        # leading space), and it must never be the one a stop string starts in.
        window = req.token_ids[max(req.num_prompt, len(req.token_ids) - pending
                                   - max(map(len, stops)) - 1):]
        text = self.detokenize(window)
        hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if hits:
            start, stop = min(hits)
            return StopDecision(n_out, "stop", stop, len(text) - start)
        # Longest suffix of the text that is a proper prefix of some stop string.
        partial = max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                       if text.endswith(s[:k])), default=0)
        held = 0  # fewest newest tokens whose text covers the partial match
        if partial:
            held = 1
            while held < pending and len(self.detokenize(window[-held:])) < partial:
                held += 1
        return StopDecision(n_out - held)
