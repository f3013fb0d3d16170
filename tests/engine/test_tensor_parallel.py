"""``tp=2`` on the CPU (two worker processes, gloo): a tiny dummy Llama (4 query heads, 2 KV heads,
2 layers, float32) gives the greedy tokens of ``tp=1`` over 64 tokens, with cascade on and off,
overlap on and off, a shared-prefix batch and a KV pool small enough to retract, and with structured
outputs (a regex, a choice) and prompt modules; an aborted request
leaves the others exact; a killed or stopped rank, or a step past the watchdog's timeout, ends the Engine with a
clear error and no process left; bad
``tp`` values are refused before anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from radixrelay import Engine, SamplingParams
from radixrelay.cli import _engine_config, _parser
from radixrelay.config import EngineConfig
from radixrelay.structured import StructuredOutput
from tests.runtime.server_process import pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SHARED = "You are a careful assistant. Answer in one short sentence, and be precise. " * 2
PROMPTS = [SHARED + q for q in ("What is the capital of France?", "Name a prime number.",
                                "What colour is the sky?", "Count to three.")] + ["1, 2, 3,", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


def _model_dir(path, **overrides):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "max_position_embeddings": 2048, "tie_word_embeddings": False, **overrides}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _engine(model: str, **options) -> Engine:
    return Engine(model=model, load_format="dummy", tokenizer="default", device="cpu", page_size=16, **options)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(model):
    with _engine(model, kv_cache_tokens=4096) as engine:
        return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("options", [
    dict(cascade="on", kv_cache_tokens=4096),
    dict(cascade="off", disable_overlap=True, kv_cache_tokens=4096),
    dict(cascade="auto", kv_cache_tokens=320, max_running_requests=6),        # retracts
], ids=["cascade-on", "cascade-off-lockstep", "small-kv"])
def test_two_ranks_give_the_tokens_of_one(model, reference, options):
    with _engine(model, tp=2, **options) as engine:
        outs = engine.generate(PROMPTS, GREEDY)
        stats = engine.stats()
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    assert [o.token_ids for o in outs] == reference
    assert len({t for toks in reference for t in toks}) > 20          # the dummy model is not degenerate
    if options["kv_cache_tokens"] < 1024:
        assert stats["num_retractions"] > 0
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["locked_tokens"] == 0


def test_structured_outputs_at_two_ranks(model):
    """Grammars run on every rank over the same gathered logits: the same constrained tokens as tp=1."""
    params = [SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutput.regex(r"[a-z]{3,8} [0-9]{2}")),
              SamplingParams(max_tokens=40, temperature=0.8, seed=5,
                             structured=StructuredOutput.choice(["red", "green", "blue"])),
              GREEDY]
    runs = []
    for tp in (1, 2):
        with _engine(model, tp=tp, kv_cache_tokens=4096) as engine:
            runs.append(engine.generate(PROMPTS[:3], params))
    one, two = runs
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert re.fullmatch(r"[a-z]{3,8} [0-9]{2}", two[0].text) and two[1].text in ("red", "green", "blue")


SCHEMA = ('<schema name="myth">'
          '<module name="intro">You answer questions about rivers of myth, briefly and accurately. </module>'
          '<module name="lethe">The river Lethe flows through the valley of sleep; whoever drinks forgets. </module>'
          '<module name="styx">The river Styx marks the border of the underworld; oaths on it hold. </module>'
          '<module name="greet">Reader: <param name="who" len="6"/>. Answer for this reader.</module>'
          '</schema>')
MODULAR = ['<prompt schema="myth"><intro/><lethe/> Which river makes you forget?</prompt>',
           '<prompt schema="myth"><styx/><intro/><greet who="Ann"/> Which river binds oaths?</prompt>']


def test_prompt_modules_at_two_ranks(model):
    """Module KV (each rank's heads) is computed once at its schema positions and reused: tp=2 gives
    tp=1's tokens, and a second round served from the module cache gives the first round's."""
    runs = []
    for tp in (1, 2):
        with _engine(model, tp=tp, kv_cache_tokens=4096) as engine:
            engine.register_schema(SCHEMA)
            first = engine.generate(MODULAR, GREEDY, prompt_schema="myth")
            again = engine.generate(MODULAR, GREEDY, prompt_schema="myth")
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
        assert all(o.error is None for o in first + again) and all(o.cached_tokens > 0 for o in again)
        runs.append(first)
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]


def test_abort_leaves_the_other_requests_exact(model, reference):
    with _engine(model, tp=2, kv_cache_tokens=4096) as engine:
        stream = engine.generate_stream(PROMPTS[0], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
        assert next(stream)
        stream.close()                   # a stream closed early aborts its request
        outs = engine.generate(PROMPTS, GREEDY)
        stats = engine.stats()
    assert [o.token_ids for o in outs] == reference
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["locked_tokens"] == 0


def test_a_killed_rank_ends_the_engine_with_a_clear_error(model):
    engine = _engine(model, tp=2, kv_cache_tokens=4096)
    try:
        processes = engine._client._processes
        pids = [p.pid for p in processes.children.values()]
        assert set(processes.children) == {"worker", "scheduler", "worker rank 1"}
        os.kill(processes.children["worker rank 1"].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="worker rank 1"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                engine.generate(PROMPTS[:2], GREEDY)
    finally:
        engine.close()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)]
    assert not processes.ipc_dir.exists()


def test_a_step_past_the_watchdog_timeout_ends_the_engine(model, monkeypatch):
    """A step that does not finish within RADIXRELAY_STEP_TIMEOUT_S (here every step: 1 ms) ends its worker
    process (as a rank stuck in a collective would), so the Engine fails with an error instead of hanging,
    and no process is left."""
    monkeypatch.setenv("RADIXRELAY_STEP_TIMEOUT_S", "0.001")
    engine = _engine(model, tp=2, kv_cache_tokens=4096)
    try:
        pids = [p.pid for p in engine._client._processes.children.values()]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker"):
            engine.generate(PROMPTS[:2], GREEDY)
        assert time.monotonic() - start < 30
    finally:
        engine.close()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)]


def test_a_stopped_rank_ends_the_engine_within_two_seconds(model):
    """SIGSTOP of rank 1 (a rank that stops running): its heartbeat goes stale, the Engine's next
    wait fails naming it within two seconds, and closing leaves no process behind."""
    engine = _engine(model, tp=2, kv_cache_tokens=4096)
    try:
        processes = engine._client._processes
        pids = [p.pid for p in processes.children.values()]
        os.kill(processes.children["worker rank 1"].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 process .* has not run for"):
            engine.generate(PROMPTS[:2], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        assert time.monotonic() - stopped < 2.5
    finally:
        engine.close()
    assert not [p for p in pids if pid_alive(p)]


def test_bad_tp_values_are_refused(tmp_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="EngineConfig.tp"):
            EngineConfig(tp=bad)
    with pytest.raises(ValueError, match="rank r runs on cuda:r"):
        EngineConfig(tp=2, device="cuda:1")
    assert _engine_config(_parser().parse_args(["serve", "--tensor-parallel-size", "2"])).tp == 2
    assert _engine_config(_parser().parse_args(["serve", "--tp", "4"])).tp == 4
    # A tp that does not split the model's heads is a start-up error naming the reason, before any process starts.
    model = _model_dir(tmp_path, num_attention_heads=6, num_key_value_heads=3, head_dim=16, hidden_size=96)
    with pytest.raises(ValueError, match="tensor parallel size 4 does not split 6 query heads"):
        _engine(model, tp=4, kv_cache_tokens=1024)
