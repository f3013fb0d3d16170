"""The DSL's pieces without a server: role markers, select scoring, validation, the interpreter
(with an in-process fake backend)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest

import radixrelay.lang as rl
from radixrelay.lang import scoring
from radixrelay.lang.runtime_backend import CallMeta, Generation
from radixrelay.lang.chat import RoleMarkers
from radixrelay.lang.expr import Gen
from radixrelay.text.chat_template import ChatTemplate

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
          "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}")


class FakeBackend:
    """Echoes: a gen returns ``"<" + last 3 chars of the prompt + ">"`` after ``delay`` seconds
    in two deltas; select prefers the longest choice; a prompt containing FAIL raises."""

    def __init__(self, delay: float = 0.0) -> None:
        self.markers = RoleMarkers.plain()
        self.delay = delay
        self.prompts: list[str] = []
        self.lock = threading.Lock()

    def generate(self, prompt: str, gen: Gen, on_text: Callable[[str], None]) -> Generation:
        started = time.monotonic()
        with self.lock:
            self.prompts.append(prompt)
        if "FAIL" in prompt:
            raise rl.BackendError("server answered 400: bad prompt", 400)
        time.sleep(self.delay)
        text = f"<{prompt[-3:]}>"
        if gen.n == 1:
            on_text(text[:2])
            on_text(text[2:])
        return Generation((text,) * gen.n, CallMeta(started, time.monotonic(), None, ("stop",) * gen.n))

    def score(self, prefix: str, choices: Sequence[str]) -> CallMeta:
        now = time.monotonic()
        return CallMeta(now, now, None, scores=tuple(float(len(c)) for c in choices))

    def prefill(self, prompt: str) -> CallMeta:
        now = time.monotonic()
        return CallMeta(now, now, None)

    def close(self) -> None:
        pass


# -- role markers -----------------------------------------------------------------------------


def test_markers_of_a_llama3_style_template_drop_a_doubled_bos():
    markers = RoleMarkers.from_template(ChatTemplate(LLAMA3, model_name="m", bos_token="<s>"), strip_bos="<s>")
    assert markers.open("user", first=True) == "<|start_header_id|>user<|end_header_id|>\n\n"
    assert markers.open("assistant", first=False) == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert markers.end["assistant"] == "<|eot_id|>"


def test_a_template_that_rewrites_content_is_refused():
    template = ChatTemplate("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}", model_name="m")
    with pytest.raises(ValueError, match="verbatim"):
        RoleMarkers.from_template(template)


def test_plain_markers():
    markers = RoleMarkers.plain()
    assert markers.open("system", first=True) + "x" + markers.end["system"] == "System: x\n"


# -- select scoring ---------------------------------------------------------------------------


def _logprobs(tokens: list[str], values: list[float | None]) -> dict:
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": values, "text_offset": offsets}


def test_scoring_drops_the_generated_token_and_counts_a_merged_one():
    prefix = scoring.prompt_entries(_logprobs(["ab", "c", "!"], [None, -1.0, -9.0]), "abc")
    assert prefix == [("ab", None), ("c", -1.0)]
    full = scoring.prompt_entries(_logprobs(["ab", "cd", "e", "!"], [None, -2.0, -4.0, -9.0]), "abcde")
    assert scoring.choice_score(prefix, full) == -3.0           # "cd" (merged) and "e"


def test_scoring_without_prompt_logprobs_fails_clearly():
    with pytest.raises(rl.BackendError, match="no prompt logprobs"):
        scoring.prompt_entries(None, "abc")


# -- validation and errors --------------------------------------------------------------------


def test_bad_arguments_fail_on_their_own_line():
    with pytest.raises(rl.ProgramError) as info:
        rl.select("x", choices="yes")
    assert info.value.origin.source == 'rl.select("x", choices="yes")'
    for call, message in [(lambda: rl.select(choices=[]), "empty"),
                          (lambda: rl.gen(max_tokens=0), "max_tokens"),
                          (lambda: rl.gen(stop=[""]), "stop"),
                          (lambda: rl.gen(top_p=0), "top_p"),
                          (lambda: rl.assistant(rl.gen(n=2)), "n=1"),
                          (lambda: rl.gen(regex="a", choices=["a"]), "at most one"),
                          (lambda: rl.gen(choices="yes"), "list of strings"),
                          (lambda: rl.gen(choices=[]), "choice"),
                          (lambda: rl.gen(json_schema="{not json"), "not valid JSON")]:
        with pytest.raises(rl.ProgramError, match=message):
            call()


def test_failed_operation_skips_the_rest_and_names_its_line():
    backend = FakeBackend()

    @rl.function
    def prog(s):
        s += "FAIL"
        s += rl.gen("a")
        s += rl.gen("b")

    with pytest.raises(rl.ProgramError, match=r'`s \+= rl.gen\("a"\)`: server answered 400') as info:
        prog.run(backend=backend)
    assert info.value.origin.function == "prog"
    assert len(backend.prompts) == 1


def test_appending_something_else_and_calling_a_program_directly():
    @rl.function
    def prog(s):
        s += 42

    with pytest.raises(rl.ProgramError, match="cannot append a int"):
        prog.run(backend=FakeBackend())
    with pytest.raises(TypeError, match=r"prog.run"):
        prog("not a state")


def test_a_program_calls_another_on_the_same_state():
    @rl.function
    def greet(s, name):
        s += f"Hello {name}. "

    @rl.function
    def prog(s):
        greet(s, "Ana")
        s += rl.gen("g")

    assert prog.run(backend=FakeBackend()).text() == "Hello Ana. <a. >"


def test_no_default_backend_is_an_error_not_a_hang(monkeypatch):
    from radixrelay.lang import runtime_backend as backend_module

    monkeypatch.setattr(backend_module, "_default", [])

    @rl.function
    def prog(s):
        s += "x"

    with pytest.raises(RuntimeError, match="set_default_backend"):
        prog.run()


# -- the interpreter --------------------------------------------------------------------------


def test_operations_run_in_order_and_state_is_read_only_after_the_run():
    @rl.function
    def prog(s):
        s += "abc"
        s += rl.gen("g")
        s += " then "
        s += rl.select("pick", choices=["x", "yyy"])
        s += rl.gen("h", n=2)

    state = prog.run(backend=FakeBackend())
    assert state.text() == "abc<abc> then yyy"
    assert state.variables() == {"g": "<abc>", "pick": "yyy", "h": ["<yyy>", "<yyy>"]}
    assert state.meta("pick").scores == (1.0, 3.0)
    with pytest.raises(rl.ProgramError, match="read-only"):
        state += "more"
    with pytest.raises(KeyError, match="no variable 'zz'"):
        state["zz"]


def test_forks_run_concurrently_and_join():
    backend = FakeBackend(delay=0.3)

    @rl.function
    def prog(s):
        s += "root:"
        forks = s.fork(4)
        for i in range(4):
            forks[i] += f"b{i}"
            forks[i] += rl.gen("out")
        forks.join()
        s += rl.gen("after")
        assert forks["out"] == [f"<:b{i}>" for i in range(4)]

    started = time.monotonic()
    prog.run(backend=backend)
    assert time.monotonic() - started < 0.3 * 4      # the four 0.3 s branches overlapped


def test_text_iter_follows_a_streaming_run():
    @rl.function
    def prog(s):
        s += "ab"
        s += rl.user(rl.gen("g"))

    state = prog.run(backend=FakeBackend(delay=0.05), stream=True)
    assert list(state.text_iter("g")) == ["<r", ": >"]        # the two deltas, as they came
    assert "".join(state.text_iter()) == state.text() == "abUser: <r: >\n"


def test_run_batch_keeps_order_and_failures():
    @rl.function
    def prog(s, text):
        s += text
        s += rl.gen("g")

    states = prog.run_batch([{"text": "aaa"}, {"text": "FAIL"}, {"text": "ccc"}], backend=FakeBackend())
    assert [s.error is None for s in states] == [True, False, True]
    assert states[0]["g"] == "<aaa>" and states[2]["g"] == "<ccc>"
    with pytest.raises(rl.ProgramError, match="server answered 400"):
        states[1]["g"]


def test_examples_compile():
    import py_compile
    from pathlib import Path

    examples = sorted((Path(__file__).parents[2] / "examples").glob("*.py"))
    assert {p.name for p in examples} >= {"self_consistency.py", "tree_of_thought.py",
                                          "few_shot_classifier.py", "batch_documents.py"}
    for path in examples:
        py_compile.compile(str(path), doraise=True)
