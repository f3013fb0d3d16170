"""Stop conditions: max_tokens, EOS, stop token ids, ignore_eos, stop strings with hold-back."""

from __future__ import annotations

from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_worker import FakeWorker, Run, collect

EOS = 2
# toy vocabulary: token id -> text
VOCAB = {10: "a", 11: "b", 12: "c", 13: "ab", 14: "cd", 15: "x", 16: "STOP", 17: "S", 18: "TOP"}


def detok(ids: list[int]) -> str:
    return "".join(VOCAB.get(i, "?") for i in ids)


def generate(script: list[int], sampling: SamplingParams, prompt=(1, 5, 7)):
    cfg = SchedulerConfig(kv_cache_tokens=128, page_size=2, eos_token_ids=(EOS,))
    sched = Scheduler(cfg, detokenize=detok)
    worker = FakeWorker(2, cfg.num_pages,
                        token_fn=lambda rid, toks: script[len(toks) - len(prompt)])
    sched.add_request(0, list(prompt), sampling)
    run, emitted_steps = Run(), []
    while sched.has_work():
        plan = sched.schedule()
        assert plan is not None
        updates = sched.process_output(worker.step(plan))
        emitted_steps.append([t for u in updates for t in u.token_ids])
        collect(run, updates)
        sched.check_integrity()
    return run.tokens.get(0, []), run.finals[0], emitted_steps


def test_max_tokens():
    toks, final, _ = generate([10] * 9, SamplingParams(max_tokens=3))
    assert toks == [10, 10, 10] and final.finish_reason == "length"


def test_eos_and_ignore_eos_and_stop_token_ids():
    toks, final, _ = generate([10, 11, EOS, 12, 12], SamplingParams(max_tokens=5))
    assert toks == [10, 11] and final.finish_reason == "stop" and final.matched_stop == EOS
    assert final.completion_tokens == 3          # the stop token is counted, not emitted
    toks, final, _ = generate([10, 11, EOS, 12, 12], SamplingParams(max_tokens=5, ignore_eos=True))
    assert toks == [10, 11, EOS, 12, 12] and final.finish_reason == "length"
    toks, final, _ = generate([10, 15, 11], SamplingParams(max_tokens=5, ignore_eos=True,
                                                           stop_token_ids=(15,)))
    assert toks == [10] and final.matched_stop == 15


def test_stop_string_is_held_back_then_trimmed():
    # "x" "S" "TOP": the text ends with a prefix of "STOP" after "S", so "S" is held back
    toks, final, steps = generate([15, 17, 18, 10], SamplingParams(max_tokens=9, stop=("STOP",)))
    assert steps[:3] == [[15], [], [17, 18]]
    assert final.finish_reason == "stop" and final.matched_stop == "STOP"
    text = detok(toks)
    assert text[: len(text) - final.trim_chars] == "x"


def test_stop_string_inside_a_token_and_across_tokens():
    # "ab" "cd" with stop "bc": the match starts inside "ab" and ends inside "cd"
    toks, final, steps = generate([15, 13, 14, 10], SamplingParams(max_tokens=9, stop=("bc",)))
    assert steps[1] == []                        # "ab" ends with "b", a prefix of "bc"
    text = detok(toks)
    assert text == "xabcd" and text[: len(text) - final.trim_chars] == "xa"


def test_held_tokens_are_released_when_the_prefix_breaks_or_the_request_ends():
    toks, _, steps = generate([17, 15, 17], SamplingParams(max_tokens=3, stop=("STOP",)))
    assert steps == [[], [17, 15], [17]]         # "S" then "x" breaks it; length flushes the last
    assert toks == [17, 15, 17]


def test_no_part_of_a_stop_string_ever_reaches_the_caller():
    stops = ("abc", "ca")
    script = [10, 11, 10, 11, 12, 10, 11, 11, 12, 12, 11]
    toks, final, steps = generate(script, SamplingParams(max_tokens=len(script), stop=stops))
    assert final.matched_stop == "abc"
    text = detok(toks)
    keep = len(text) - final.trim_chars          # the stop string starts here
    assert text[:keep] == "ab"
    shown = ""
    for emitted in steps[:-1]:                   # before the final update
        shown += detok(emitted)
        assert len(shown) <= keep                # never a character of the stop string
