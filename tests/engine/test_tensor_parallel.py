"""``tp=2`` on the CPU (two worker processes, gloo): a tiny dummy Llama (4 query heads, 2 KV heads,
2 layers, float32) gives the greedy tokens of ``tp=1`` over 32 tokens, with cascade on (overlapped, a KV
pool small enough to retract) and off (lock step), a shared-prefix batch, and with structured outputs
(a regex, a choice) and prompt modules; an aborted request leaves the others exact; KV tiers (host
memory, then disk across a restart) give the same tokens, and a page one rank's disk directory lacks is
a miss on both; a killed or stopped rank, or a step past the watchdog's timeout (at tp=1), ends the Engine
with a clear error and no process left; bad ``tp`` values are refused before anything starts."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time

import pytest

from radixrelay import Engine, SamplingParams
from radixrelay.cli import _engine_config, _parser
from radixrelay.config import EngineConfig
from radixrelay.radix.disk_store import HEADER
from radixrelay.structured import StructuredOutput
from tests.runtime.server_process import pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SHARED = "You are a careful assistant. Answer in one short sentence, and be precise. " * 2
PROMPTS = [SHARED + q for q in ("What is the capital of France?", "Name a prime number.",
                                "What colour is the sky?", "Count to three.")] + ["1, 2, 3,", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)      # its tokens start GREEDY's


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


# One Engine per configuration for the whole module (an Engine start, three processes at tp=2, costs far
# more than its requests): tp=1 for the references (the tier tests' too), and two tp=2 Engines that the
# exactness, structured, module and abort tests share. The tests that end an Engine (a killed or stopped
# rank) come last in the file and end one of these; the watchdog test starts its own.
@pytest.fixture(scope="module")
def one(model):
    with _engine(model, kv_cache_tokens=4096) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(one):
    return [o.token_ids for o in one.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def overlapped(model):
    """Cascade on every shared node, overlapped steps, and a KV pool small enough to retract."""
    with _engine(model, tp=2, cascade="on", kv_cache_tokens=160, max_running_requests=6) as engine:
        yield engine


@pytest.fixture(scope="module")
def lockstep(model):
    """Flat attention, the scheduler and workers in lock step, a pool that holds every request."""
    with _engine(model, tp=2, cascade="off", disable_overlap=True, kv_cache_tokens=4096) as engine:
        yield engine


@pytest.mark.parametrize("name", ["overlapped", "lockstep"])
def test_two_ranks_give_the_tokens_of_one(name, reference, request):
    engine = request.getfixturevalue(name)
    outs = engine.generate(PROMPTS, GREEDY)
    stats = engine.stats()
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    assert [o.token_ids for o in outs] == reference
    assert len({t for toks in reference for t in toks}) > 20          # the dummy model is not degenerate
    if name == "overlapped":
        assert stats["num_retractions"] > 0                            # its pool is too small for the batch
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["locked_tokens"] == 0


def test_structured_outputs_at_two_ranks(one, overlapped):
    """Grammars run on every rank over the same gathered logits: the same constrained tokens as tp=1."""
    params = [SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutput.regex(r"[a-z]{3,8} [0-9]{2}")),
              SamplingParams(max_tokens=40, temperature=0.8, seed=5,
                             structured=StructuredOutput.choice(["red", "green", "blue"])),
              SHORT]
    one_rank, two = (engine.generate(PROMPTS[:3], params) for engine in (one, overlapped))
    assert [o.token_ids for o in two] == [o.token_ids for o in one_rank]
    assert re.fullmatch(r"[a-z]{3,8} [0-9]{2}", two[0].text) and two[1].text in ("red", "green", "blue")


SCHEMA = ('<schema name="myth">'
          '<module name="intro">You answer questions about rivers of myth, briefly and accurately. </module>'
          '<module name="lethe">The river Lethe flows through the valley of sleep; whoever drinks forgets. </module>'
          '<module name="styx">The river Styx marks the border of the underworld; oaths on it hold. </module>'
          '<module name="greet">Reader: <param name="who" len="6"/>. Answer for this reader.</module>'
          '</schema>')
MODULAR = ['<prompt schema="myth"><intro/><lethe/> Which river makes you forget?</prompt>',
           '<prompt schema="myth"><styx/><intro/><greet who="Ann"/> Which river binds oaths?</prompt>']


def test_prompt_modules_at_two_ranks(one, overlapped):
    """Module KV (each rank's heads) is computed once at its schema positions and reused: tp=2 gives
    tp=1's tokens, and a second round served from the module cache gives the first round's."""
    runs = []
    for engine in (one, overlapped):
        engine.register_schema(SCHEMA)
        first = engine.generate(MODULAR, SHORT, prompt_schema="myth")
        again = engine.generate(MODULAR, SHORT, prompt_schema="myth")
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
        assert all(o.error is None for o in first + again) and all(o.cached_tokens > 0 for o in again)
        runs.append(first)
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]


def test_abort_leaves_the_other_requests_exact(overlapped, reference):
    stream = overlapped.generate_stream(PROMPTS[0], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert next(stream)
    stream.close()                       # a stream closed early aborts its request
    outs = overlapped.generate(PROMPTS, SHORT)
    stats = overlapped.stats()
    assert [o.token_ids for o in outs] == [toks[:16] for toks in reference]
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["locked_tokens"] == 0


# -- KV tiers at tp=2 -------------------------------------------------------------------------------------
# Each rank keeps its own KV heads in host memory and on disk under the page keys every rank shares, and rank 0
# acknowledges a transfer only once both ranks completed it. Sessions pushed off a small device pool come back
# from host memory, then (after a restart on the same disk directory) from disk, with the greedy tokens of tp=1
# without tiers (the module's tp=1 Engine); pages whose file one rank lacks are recomputed at the restart.

TIER_GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
WORDS = "river stone lantern orchard copper meadow falcon harbor violet thunder maple glacier canyon".split()
SESSIONS = [f"Session {i}: " + " ".join(random.Random(i).choice(WORDS) for _ in range(70)) for i in range(4)]
DISTRACTOR = " ".join(f"note{i} alpha beta" for i in range(60))
PAGE_BYTES = 2 * 2 * 16 * 1 * 16 * 4            # a rank's page: layers x K/V x tokens x KV heads x dim x fp32
TIERS = dict(kv_cache_tokens=320, host_kv_gib=2 * 64 * PAGE_BYTES / (1 << 30))   # 64 host pages a rank


@pytest.fixture(scope="module")
def tier_reference(one):
    """tp=1 without tiers: the sessions' tokens, then the distractor's."""
    return [o.token_ids for o in one.generate(SESSIONS + [DISTRACTOR], TIER_GREEDY)]


def _kv_files(directory) -> set[str]:
    return {p.name for p in directory.glob("*.kv")}


@pytest.fixture(scope="module")
def tier_runs(model, tmp_path_factory):
    """Two tp=2 Engines on one disk directory, read by both tier tests:

    1. the sessions, then (once every rank's directory holds their pages) the distractor, which pushes
       them off the device, then the sessions again, from host memory;
    2. after rank 1's files of the distractor's pages are deleted, a restart: the sessions from disk,
       then the distractor, whose pages only rank 0 still holds."""
    disk = tmp_path_factory.mktemp("tiers") / "kv"
    out = {}
    with _engine(model, tp=2, disk_kv_path=str(disk), **TIERS) as engine:
        out["first"] = engine.generate(SESSIONS, TIER_GREEDY)
        # The disk writes follow the host copies' acknowledgements: wait until every page in host memory is
        # on disk, in both ranks' directories.
        deadline = time.monotonic() + 60
        while True:
            stats = engine.stats()
            ranks = sorted(disk.iterdir())
            names = [_kv_files(d) for d in ranks]
            if (len(ranks) == 2 and names[0] == names[1]
                    and len(names[0]) == stats["tier_disk_used_pages"] == stats["tier_host_used_pages"] > 0):
                break
            assert time.monotonic() < deadline, f"the sessions' pages never all reached disk: {stats}, {names}"
            time.sleep(0.05)
        out["session_files"] = names[0]
        engine.generate([DISTRACTOR], TIER_GREEDY)             # pushes the sessions off the device
        out["again"] = engine.generate(SESSIONS, TIER_GREEDY)
        out["stats"] = engine.stats()
    out["ranks"] = ranks
    out["names"] = [_kv_files(d) for d in ranks]
    out["sizes"] = {p.stat().st_size for d in ranks for p in d.glob("*.kv")}
    out["distractor_files"] = out["names"][1] - out["session_files"]
    for name in out["distractor_files"]:
        (ranks[1] / name).unlink()

    with _engine(model, tp=2, disk_kv_path=str(disk), **TIERS) as engine:      # a restart
        out["restarted"] = engine.generate(SESSIONS, TIER_GREEDY)
        out["restart_stats"] = engine.stats()
        out["distractor"] = engine.generate([DISTRACTOR], TIER_GREEDY)[0]
        out["distractor_stats"] = engine.stats()
    return out


def test_host_then_disk_tiers_at_two_ranks(tier_runs, tier_reference):
    runs = tier_runs
    first, again, stats = runs["first"], runs["again"], runs["stats"]
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == tier_reference[:4]
    assert stats["tier_host_pages"] == 64 and stats["tier_host_hit_tokens"] >= 4 * 64
    assert all(o.cached_tokens > 0 for o in again)
    assert stats["rank0_device_s"] > 0 and stats["rank1_device_s"] > 0
    # the embedding's and two per layer, every forward, each timed (gloo)
    assert stats["tp_all_reduces"] >= 5 * stats["steps"] // 2 and stats["tp_all_reduce_s"] > 0
    # one directory per rank, holding the same pages (each its rank's share of the KV heads)
    assert len(runs["ranks"]) == 2
    assert runs["names"][0] == runs["names"][1] and runs["names"][0] > runs["session_files"]
    assert runs["sizes"] == {HEADER.size + PAGE_BYTES}

    stats = runs["restart_stats"]                      # the restart: the sessions' pages are on both ranks
    assert [o.token_ids for o in runs["restarted"]] == tier_reference[:4]
    assert stats["tier_disk_hit_tokens"] >= 4 * 64 and stats["tier_read_failed_pages"] == 0


def test_a_page_missing_on_one_rank_is_a_miss_on_both(tier_runs, tier_reference):
    """Files one rank's directory lacks are not indexed at a restart: the distractor's pages, deleted from
    rank 1's directory only, are recomputed, and its tokens stay those of tp=1."""
    runs = tier_runs
    assert runs["distractor_files"] and runs["distractor_files"] <= runs["names"][0]      # rank 0 kept them
    stats, before = runs["distractor_stats"], runs["restart_stats"]
    assert runs["distractor"].token_ids == tier_reference[4]
    assert runs["distractor"].cached_tokens == 0
    assert stats["tier_disk_hit_tokens"] == before["tier_disk_hit_tokens"]
    assert stats["tier_read_failed_pages"] == 0


# -- failures ------------------------------------------------------------------------------------------------

def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not [p for p in pids if pid_alive(p)]


def test_a_killed_rank_ends_the_engine_with_a_clear_error(lockstep):
    """Ends the module's lockstep Engine (its other tests ran before)."""
    engine = lockstep
    try:
        processes = engine._client._processes
        pids = [p.pid for p in processes.children.values()]
        assert set(processes.children) == {"worker", "scheduler", "worker rank 1"}
        os.kill(processes.children["worker rank 1"].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="worker rank 1"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                engine.generate(PROMPTS[:2], SHORT)
    finally:
        engine.close()
    assert _gone(pids)
    assert not processes.ipc_dir.exists()


def test_a_step_past_the_watchdog_timeout_ends_the_engine(model, monkeypatch):
    """A step that does not finish within RADIXRELAY_STEP_TIMEOUT_S (here every step: 1 ms) ends its worker
    process (as a rank stuck in a collective would), so the Engine fails with an error instead of hanging,
    and no process is left. At tp=1: every rank runs the same watchdog in the same worker loop, and a tp=2
    worker process that exits ending the Engine with no process left is the killed-rank test above."""
    monkeypatch.setenv("RADIXRELAY_STEP_TIMEOUT_S", "0.001")
    engine = _engine(model, kv_cache_tokens=1024)
    try:
        pids = [p.pid for p in engine._client._processes.children.values()]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker"):
            engine.generate(PROMPTS[:2], SHORT)
        assert time.monotonic() - start < 30
    finally:
        engine.close()
    assert _gone(pids)


def test_a_stopped_rank_ends_the_engine_within_two_seconds(overlapped):
    """SIGSTOP of rank 1 (a rank that stops running): its heartbeat goes stale, the Engine's next
    wait fails naming it within two seconds, and closing leaves no process behind. Ends the module's
    overlapped Engine (its other tests ran before)."""
    engine = overlapped
    try:
        processes = engine._client._processes
        pids = [p.pid for p in processes.children.values()]
        os.kill(processes.children["worker rank 1"].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 process .* has not run for"):
            engine.generate(PROMPTS[:2], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
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
