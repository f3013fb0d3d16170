"""Stop strings: bounds on the list, agreement with a whole-text reference on random scripts, and a
per-token cost that does not grow with the number or length of the stop strings."""

from __future__ import annotations

import random
import statistics
import time

import pytest

from radixrelay.model.model_registry import resolve_model_path
from radixrelay.sampling_params import MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, SamplingParams
from radixrelay.scheduler.request import Request
from radixrelay.scheduler.stop import StopChecker
from radixrelay.text.tokenizer import load_tokenizer
from tests.scheduler.test_stop import VOCAB, detok, generate


def test_stop_list_bounds():
    at_limit = tuple(f"{i:03d}" + "x" * (MAX_STOP_STRING_CHARS - 3) for i in range(MAX_STOP_STRINGS))
    assert SamplingParams(stop=at_limit).stop == at_limit
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} stop strings"):
        SamplingParams(stop=tuple(str(i) for i in range(MAX_STOP_STRINGS + 1)))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRING_CHARS} characters"):
        SamplingParams(stop=("y" * (MAX_STOP_STRING_CHARS + 1),))


def _reference(script: list[int], stops: tuple[str, ...]) -> tuple[str, str | None]:
    """The text the caller ends with and the stop string matched: the first token after which the
    text contains a stop string ends the output before the earliest one (ties: the smallest)."""
    for t in range(1, len(script) + 1):
        text = detok(script[:t])
        hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if hits:
            start, stop = min(hits)
            return text[:start], stop
    return detok(script), None


@pytest.mark.parametrize("seed", range(40))
def test_random_scripts_agree_with_the_whole_text_reference(seed):
    rng = random.Random(seed)
    ids = [i for i in VOCAB if i != 16]
    script = [rng.choice(ids) for _ in range(rng.randint(1, 24))]
    text = detok(script)
    stops = set()
    for _ in range(rng.randint(1, 4)):        # pieces of the text (some match) and random strings
        if rng.random() < 0.6 and len(text) > 1:
            a = rng.randrange(len(text) - 1)
            stops.add(text[a:a + rng.randint(1, 5)])
        else:
            stops.add("".join(rng.choice("abcdxST") for _ in range(rng.randint(1, 4))))
    stops = tuple(sorted(stops))
    toks, final, steps = generate(script, SamplingParams(max_tokens=len(script), stop=stops, ignore_eos=True))
    want_text, want_stop = _reference(script, stops)
    got = detok(toks)
    assert got[:len(got) - final.trim_chars] == want_text
    assert final.matched_stop == want_stop and final.finish_reason == ("stop" if want_stop else "length")
    shown = ""
    for emitted in steps[:-1]:               # never a character of a stop string before the end
        shown += detok(emitted)
        assert want_text.startswith(shown)


def _per_token_seconds(checker: StopChecker, prompt: list[int], outputs: list[int],
                       stops: tuple[str, ...]) -> float:
    """Median seconds of ``on_token`` over ``outputs``, emitting what it releases as a scheduler does."""
    sampling = SamplingParams(max_tokens=len(outputs) + 1, stop=stops, ignore_eos=True)
    req = Request(rid=0, token_ids=list(prompt), num_prompt=len(prompt), sampling=sampling, salt=None, arrival=0)
    times = []
    for token in outputs:
        req.token_ids.append(token)
        start = time.perf_counter()
        decision = checker.on_token(req)
        times.append(time.perf_counter() - start)
        assert decision.finish_reason is None
        req.num_emitted = decision.emit_upto
    return statistics.median(times)


def test_per_token_cost_does_not_grow_with_the_stop_list():
    """The largest allowed list, built so that the output always continues a partial match of every
    string (the worst case for a scan per string), against one short stop string: the same text, the
    real tokenizer's decode. Medians per token, interleaved repeats, the best of each."""
    tok = load_tokenizer(resolve_model_path("default"))
    a = tok.encode("a", add_special_tokens=False)
    aa = tok.encode("aa", add_special_tokens=False)
    assert len(a) == len(aa) == 1 and tok.decode(a + aa) == "aaa"
    outputs = [aa[0], a[0]] * 200                   # "aaaa...": 600 characters
    prompt = tok.encode("Say a:", add_special_tokens=False)
    worst = tuple("a" * (MAX_STOP_STRING_CHARS - 1) + chr(0x100 + i) for i in range(MAX_STOP_STRINGS))
    baseline = ("\n\n",)
    checker = StopChecker((), lambda ids: tok.decode(ids))
    costs: dict[tuple[str, ...], list[float]] = {worst: [], baseline: []}
    for _ in range(5):
        for stops in (worst, baseline):
            costs[stops].append(_per_token_seconds(checker, prompt, outputs, stops))
    assert min(costs[worst]) < 3 * min(costs[baseline]), {len(k): v for k, v in costs.items()}
