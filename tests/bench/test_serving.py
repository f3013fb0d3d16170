"""bench_serving against a real ``radixrelay serve`` (on CPU, tiny workloads; the tiny dummy model of
``tests/runtime/server_process.py``, served as ``default``: the figures do not depend on its words):
every workload completes with sane figures, the cache shows up in ``cached_tokens``, sweeps and
comparisons write their plots, and server-side errors become failed requests."""

from __future__ import annotations

import json

import pytest

from radixrelay.bench.command import main
from tests.runtime.server_process import ServerProcess

pytestmark = pytest.mark.timeout(900)
N = 3
TINY = {   # N requests of each: groups / sessions / subjects / problems of two (the last has one), two tokens out
    "shared-prefix": ["groups=2", "prompts_per_group=2", "system_len=48", "question_len=6",
                      "output_len=2"],
    "sharegpt-like": ["input_mean=12", "output_mean=2", "sigma=0.5", "min_len=2", "max_input=24",
                      "max_output=3"],
    "multi-turn": ["sessions=2", "turns=2", "system_len=24", "turn_len=6", "output_len=2",
                   "think_time=0.05"],
    "few-shot": ["subjects=2", "questions_per_subject=2", "shots=2", "example_len=20",
                 "question_len=18", "output_len=2"],
    "tree": ["problems=2", "samples=2", "prefix_len=32", "problem_len=8", "output_len=2"],
    "random": ["input_len=16", "output_len=2", "range_ratio=0.5"],
}
EXTRA = {  # cover both endpoints, non-streaming and a concurrency limit along the way
    "shared-prefix": ["--max-concurrency", "2"],
    "few-shot": ["--disable-stream"],
    "random": ["--endpoint", "completions", "--warmup-requests", "1"],
    "multi-turn": ["--client-processes", "2"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    srv = ServerProcess(tmp_path_factory.mktemp("bench"), *tiny_model, "--kv-cache-tokens", "8192")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def bench(server, out, workload, *args) -> tuple[int, dict]:
    params = [arg for p in TINY[workload] for arg in ("-P", p)]
    rc = main(["--base-url", server.base_url, "--workload", workload, *params, "--seed", "1",
               "--output", str(out), *args])
    return rc, json.loads(out.read_text())


def assert_sane(summary: dict, streamed: bool) -> None:
    keys = ("ttft_ms", "e2e_ms", "tpot_ms", "itl_ms") if streamed else ("ttft_ms", "e2e_ms")
    for key in keys:
        st = summary[key]
        assert st["p99"] >= st["p90"] >= st["p50"] > 0 and st["mean"] > 0, (key, st)
    assert summary["request_throughput"] > 0 and summary["output_token_throughput"] > 0
    assert summary["token_sources"] == {"usage": summary["completed"]}


@pytest.mark.parametrize("workload", list(TINY))
def test_workload(server, tmp_path, workload):
    rc, results = bench(server, tmp_path / "r.json", workload, "--num-requests", str(N),
                        "--request-rate", "20", *EXTRA.get(workload, []))
    assert rc == 0
    [run] = results["runs"]
    summary, requests = run["summary"], run["requests"]
    assert (summary["completed"], summary["failed"], summary["errors"]) == (N, 0, {})
    assert_sane(summary, streamed="--disable-stream" not in EXTRA.get(workload, []))
    assert len(requests) == N and all(r["ok"] and r["prompt_tokens"] > 0 for r in requests)
    assert all(r["completion_tokens"] == r["max_tokens"] for r in requests)        # ignore_eos
    assert results["config"]["model"] == "default" and results["config"]["num_requests"] == N
    if workload in ("shared-prefix", "multi-turn"):
        assert summary["total_cached_tokens"] > 0 and 0 < summary["cache_hit_ratio"] < 1
    if "--client-processes" in EXTRA.get(workload, []):    # sessions split over two processes, one schedule
        assert results["config"]["client_processes"] == 2
        sessions = {r["session"] for r in requests}
        assert {s % 2 for s in sessions} == {0, 1}
        assert [r["start_s"] for r in requests] == sorted(r["start_s"] for r in requests)
        for s in sessions:
            turns = [r for r in requests if r["session"] == s]
            assert [r["turn"] for r in turns] == list(range(len(turns)))


def test_sweep_then_compare(server, tmp_path):
    rc, results = bench(server, tmp_path / "sweep.json", "random", "--num-requests", "2",
                        "--sweep-rates", "4,inf", "--slo-ttft", "60000", "--slo-tpot", "60000")
    assert rc == 0
    assert [run["request_rate"] for run in results["runs"]] == [4.0, "inf"]
    for run in results["runs"]:
        assert run["summary"]["completed"] == 2 and run["summary"]["goodput"] > 0
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert (tmp_path / "sweep.md").read_text().count("| random |") == 2

    assert main(["--compare", str(tmp_path / "sweep.json"), str(tmp_path / "sweep.json"),
                 "--labels", "on", "off", "--output", str(tmp_path / "cmp.png")]) == 0
    assert (tmp_path / "cmp.png").stat().st_size > 0
    assert (tmp_path / "cmp.md").read_text().count("| on |") == 2


def test_server_errors_are_failed_requests(server, tmp_path):
    rc, results = bench(server, tmp_path / "r.json", "random", "--num-requests", "2",
                        "--model", "no-such-model")
    assert rc == 1
    summary = results["runs"][0]["summary"]
    assert (summary["completed"], summary["failed"]) == (0, 2)
    [(message, count)] = summary["errors"].items()
    assert message.startswith("HTTP 400") and "no-such-model" in message and count == 2
