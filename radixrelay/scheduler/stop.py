"""Stop conditions for one sampled token: stop token ids, EOS, stop strings, max_tokens.

Stop strings are matched on the request's output text, decoded incrementally from the injected
``detokenize`` (two decodes of a few tokens per step, never of the whole output: the scheme of
``text.detokenizer.IncrementalDetokenizer``, with the last few prompt tokens as context so the
first output token keeps its leading space). The text runs through an Aho-Corasick automaton of
the request's stop strings, built once per distinct list and cached, so a token costs O(characters
it adds) whatever the number and length of the stop strings (both bounded by ``SamplingParams``).

The automaton's state after the text is the longest suffix of the text that is a prefix of some
stop string. The fewest newest tokens whose characters cover that suffix are held back, so no
partial stop string ever reaches the caller; they are released once the text moves on, or when the
request ends otherwise. Tokens that end inside a multi-byte character add no characters until a
later token completes it (the characters count for the completing token).
"""

from __future__ import annotations

import bisect
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from radixrelay.protocol.messages import FinishReason
from radixrelay.scheduler.request import Request

Detokenize = Callable[[list[int]], str]

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5        # prompt tokens decoded as context for the first output token
_MAX_UNDECODED = 8         # a longer run without new characters is taken as it decodes (bounds the window)
_AUTOMATA = 64             # distinct stop lists kept compiled


@dataclass(frozen=True)
class StopDecision:
    emit_upto: int                    # outputs [num_emitted, emit_upto) may go to the caller now
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    trim_chars: int = 0               # characters to drop from the end of the emitted text


class StopAutomaton:
    """Aho-Corasick automaton of a list of stop strings. State 0 is the empty string; every state
    is a prefix of some stop string, ``depth[s]`` its length, and ``match[s]`` the longest stop
    string that is a suffix of it (None if none is)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal: list[str | None] = [None]
        for stop in stops:
            s = 0
            for ch in stop:
                nxt = goto[s].get(ch)
                if nxt is None:
                    nxt = goto[s][ch] = len(goto)
                    goto.append({})
                    depth.append(depth[s] + 1)
                    terminal.append(None)
                s = nxt
            terminal[s] = stop
        fail = [0] * len(goto)
        match = list(terminal)
        queue = deque(goto[0].values())
        while queue:                   # breadth first: a state's fail link is shallower than it
            s = queue.popleft()
            if match[s] is None:
                match[s] = match[fail[s]]
            for ch, t in goto[s].items():
                f = fail[s]
                while f and ch not in goto[f]:
                    f = fail[f]
                nxt = goto[f].get(ch, 0)
                fail[t] = nxt if nxt != t else 0
                queue.append(t)
        self.goto, self.fail, self.depth, self.match = goto, fail, depth, match

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)


class _TextState:
    """One request's decoding and matching state: ``window`` holds decode context and the ids
    whose characters are not out yet (``[read, len)``); ``held_chars[i]`` is the running total of
    characters of the outputs from ``first`` on (outputs before ``first`` are emitted)."""

    def __init__(self, automaton: StopAutomaton, req: Request) -> None:
        self.automaton = automaton
        window = req.token_ids[max(0, req.num_prompt - _CONTEXT_TOKENS):req.num_prompt]
        self.window = list(window)
        self.read = len(self.window)
        self.node = 0
        self.seen = req.num_prompt         # token_ids[:seen] are decoded or in window
        self.first = req.num_prompt        # absolute index of the first output in held_chars
        self.held_chars: list[int] = []


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], detokenize: Detokenize | None) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self._automata: OrderedDict[tuple[str, ...], StopAutomaton] = OrderedDict()
        self._states: weakref.WeakKeyDictionary[Request, _TextState] = weakref.WeakKeyDictionary()

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

    def automaton(self, stops: tuple[str, ...]) -> StopAutomaton:
        found = self._automata.get(stops)
        if found is None:
            found = self._automata[stops] = StopAutomaton(stops)
            while len(self._automata) > _AUTOMATA:
                self._automata.popitem(last=False)
        else:
            self._automata.move_to_end(stops)
        return found

    def _stop_strings(self, req: Request) -> StopDecision:
        assert self.detokenize is not None  # Scheduler.add_request refuses stop strings without
        st = self._states.get(req)
        if st is None or st.seen != len(req.token_ids) - 1 or st.first > req.num_prompt + req.num_emitted:
            st = self._states[req] = _TextState(self.automaton(req.sampling.stop), req)
            for i in range(req.num_prompt, len(req.token_ids) - 1):      # outputs seen before (rare)
                self._advance(st, req.token_ids[i])
        best = self._advance(st, req.token_ids[-1])
        n_out = req.num_outputs
        if best is not None:
            self._states.pop(req, None)
            return StopDecision(n_out, "stop", best[1], best[0])
        # Drop outputs already emitted from the running totals; then hold the fewest newest outputs
        # whose characters cover the partial match.
        emitted = req.num_prompt + req.num_emitted - st.first
        if emitted > 0:
            base = st.held_chars[emitted - 1]
            st.held_chars = [c - base for c in st.held_chars[emitted:]]
            st.first += emitted
        partial = st.automaton.depth[st.node]
        if not partial:
            return StopDecision(n_out)
        total = st.held_chars[-1]
        # outputs from index k on cover ``partial`` chars: total - held_chars[k - 1] >= partial
        k = bisect.bisect_right(st.held_chars, total - partial)
        held = len(st.held_chars) - k
        pending = n_out - req.num_emitted
        return StopDecision(n_out - min(max(held, 1), pending))

    def _advance(self, st: _TextState, token: int) -> tuple[int, str] | None:
        """Feed one output token; the earliest stop string found in the characters it completes, as
        (characters from its start to the end of the text, stop string), or None."""
        st.window.append(token)
        st.seen += 1
        text = ""
        decode = self.detokenize
        assert decode is not None
        prefix = decode(st.window[:st.read])
        full = decode(st.window)
        if (len(full) > len(prefix) and not full.endswith(_REPLACEMENT)) \
                or len(st.window) - st.read >= _MAX_UNDECODED:
            text = full[len(prefix):]
            del st.window[:st.read]
            st.read = len(st.window)
        st.held_chars.append((st.held_chars[-1] if st.held_chars else 0) + len(text))
        auto, node, best = st.automaton, st.node, None
        for j, ch in enumerate(text):
            node = auto.step(node, ch)
            stop = auto.match[node]
            if stop is not None:
                key = (len(text) - j - 1 + len(stop), stop)     # (trim_chars, stop): largest trim first
                if best is None or key[0] > best[0] or (key[0] == best[0] and stop < best[1]):
                    best = key
        st.node = node
        return best
