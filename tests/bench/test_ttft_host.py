"""The TTFT host-work benchmark's stage timings run against today's server and scheduler code (a CPU
benchmark: it must not drift from the APIs it times)."""

from __future__ import annotations

from benchmarks.serving.bench_ttft_host import stages


def test_stages_time_every_stage_of_a_cached_prompt() -> None:
    (row,) = stages([200], repeats=2, page_size=16)
    assert row["words"] == 200 and row["prompt_tokens"] > 200
    for stage in ("json body", "chat template", "tokenize", "request -> choices", "ipc: request to scheduler",
                  "add_request", "schedule", "total host"):
        assert row[stage] > 0.0, stage                # each stage ran (and took time)
    assert row["total host"] < 1000.0
