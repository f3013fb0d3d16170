"""The scheduler's timeline (``RADIXRELAY_STEP_LOG``, ``scheduler/step_log.py``) through a real Engine on the
tiny dummy model: one ``arrive`` line per request, every step sent (``step``) answered (``done``), and the
page ids each plan carries (``pages``): a burst of questions over a cached document of more than
``SHARED_PAGES_BY_REF`` pages sends the document's page ids once, not once per question."""

from __future__ import annotations

from radixrelay import Engine, SamplingParams
from radixrelay.scheduler.scheduler import SHARED_PAGES_BY_REF
from tests.runtime.server_process import TINY_ENGINE

PAGE = 16


def test_the_step_log_counts_the_page_ids_each_plan_carries(tmp_path, monkeypatch, tiny_model_dir):
    log = tmp_path / "steps.tsv"
    monkeypatch.setenv("RADIXRELAY_STEP_LOG", str(log))
    doc = list(range(1000, 1000 + PAGE * (SHARED_PAGES_BY_REF + 16)))          # 80 whole pages
    questions = [doc + [7, 8, q] for q in range(8)]
    with Engine(model=str(tiny_model_dir), **TINY_ENGINE, kv_cache_tokens=8192) as engine:
        engine.generate([doc], SamplingParams(max_tokens=1))
        outs = engine.generate(questions, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert all(o.cached_tokens >= len(doc) - PAGE for o in outs)
    lines = [line.rstrip("\n").split("\t") for line in log.read_text().splitlines()]
    arrivals = [f for f in lines if f[0] == "arrive"]
    steps = {int(f[2]): f for f in lines if f[0] == "step"}
    done = {int(f[2]) for f in lines if f[0] == "done"}
    assert len(arrivals) == 1 + len(questions)
    assert set(steps) <= done
    doc_pages = len(doc) // PAGE
    admitting = [f for f in steps.values() if int(f[4]) > 1]           # steps with several extend requests
    assert admitting, steps
    for f in admitting:
        extends, pages = int(f[4]), int(f[8])
        # the document's pages once, then each question's own page: not ``extends`` x the document
        assert pages <= doc_pages + 2 * extends, (extends, pages)
