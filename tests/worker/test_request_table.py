"""The worker's request table: the one writer of residency. Admissions, releases and page appends go
through ``RequestTable.apply``, which keeps the structures beside the entries (the device page table, the
newest-token rows, the decode runs' checks) in step; no other worker module admits into or releases from
them; ``min_tokens`` bans last exactly until a row has that many outputs."""

from __future__ import annotations

import ast
from pathlib import Path

import radixrelay
from radixrelay.attention.metadata import DevicePageTable
from radixrelay.cascade.batch import DecodeRunsCache
from radixrelay.protocol.step import AdmittedRequest, PageAppend, StepPlan
from radixrelay.sampling_params import SamplingParams
from radixrelay.worker.request_table import RequestTable
from radixrelay.worker.step_state import ResidentTokens


def table() -> RequestTable:
    return RequestTable(DevicePageTable("cpu", rows=2, cols=4), ResidentTokens("cpu", 32, rows=2),
                        DecodeRunsCache(4, "cpu"), None)


def admitted(rid: int, pages: list[int], **sampling) -> AdmittedRequest:
    return AdmittedRequest(rid, [1, 2, 3, 4, 5], 5, pages, SamplingParams(max_tokens=8, **sampling))


def test_apply_keeps_every_structure_in_step():
    t = table()
    t.apply(StepPlan(1, admitted=[admitted(7, [3, 4]), admitted(9, [5, 6], min_tokens=2)]))
    assert len(t) == 2 and t[7].pages == [3, 4] and t.pages_of(9) == [5, 6] and set(t.banned) == set()
    t.apply(StepPlan(2, page_appends=[PageAppend(7, [8])]))
    assert t[7].pages == [3, 4, 8] and t.appends == [(7, 2, [8])]
    assert t.page_table.gather([7]).tolist()[0][:3] == [3, 4, 8]
    t.apply(StepPlan(3, released=[7]))
    assert len(t) == 1 and 7 not in t.page_table._row and 7 not in t.tokens._rows.row
    t.apply(StepPlan(4, released=[7, 9], admitted=[admitted(7, [1])]))    # released, then admitted again
    assert len(t) == 1 and t[7].pages == [1] and t.page_table.gather([7]).tolist()[0][:1] == [1]


def test_min_tokens_bans_until_the_outputs_exist():
    t = table()
    t.apply(StepPlan(1, admitted=[AdmittedRequest(1, [1, 2], 2, [0], SamplingParams(max_tokens=8, min_tokens=2),
                                                  min_tokens_ban=[0, 5])]))
    res = t[1]
    assert t.min_tokens_bans([res]) == ([0, 0], [0, 5])        # 0 outputs
    res.num_tokens += 1
    assert t.min_tokens_bans([res]) == ([0, 0], [0, 5])        # 1
    res.num_tokens += 1
    assert t.min_tokens_bans([res]) == ([], []) and not t.banned and res.min_tokens_ban == []


def test_only_the_request_table_admits_and_releases():
    """One writer: no other worker module calls ``admit`` / ``release`` on the structures the table owns."""
    worker = Path(radixrelay.__file__).parent / "worker"
    owned = {"_page_table", "_tokens", "_decode_runs", "page_table", "tokens", "decode_runs"}
    offenders = []
    for path in worker.glob("*.py"):
        if path.name == "request_table.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("admit", "release") and isinstance(node.func.value, ast.Attribute)
                    and node.func.value.attr in owned):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_an_admission_takes_its_shared_pages_from_an_earlier_one():
    """``pages_from``: the leading pages of a request admitted before it in the plan, on the host and on the
    device; the source's own later pages are not taken."""
    t = table()
    shared = AdmittedRequest(2, [9], 5, [30, 31], SamplingParams(max_tokens=8), pages_from=1, pages_shared=3)
    t.apply(StepPlan(1, admitted=[admitted(1, [10, 11, 12, 13]), shared]))
    assert t[2].pages == [10, 11, 12, 30, 31] and t[1].pages == [10, 11, 12, 13]
    assert t[2].pages is not t[1].pages
    assert t.page_table.gather([1, 2]).tolist() == [[10, 11, 12, 13, 0], [10, 11, 12, 30, 31]]
