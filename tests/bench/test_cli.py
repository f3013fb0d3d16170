"""The command line without a server: a dead server gives failed requests (not a crash), invalid
arguments exit 2, and reports and plots come out of results files."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from radixrelay.bench import report
from radixrelay.bench.command import main
from tests.bench.test_metrics import record

ROOT = Path(__file__).resolve().parents[2]
MODULE = "benchmarks.serving.bench_serving"     # run as its docstring says, from the repository root


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_dead_server_gives_failed_requests(tmp_path):
    out = tmp_path / "dead.json"
    proc = subprocess.run(
        [sys.executable, "-m", MODULE, "--base-url", f"http://127.0.0.1:{closed_port()}",
         "--workload", "shared-prefix", "-P", "groups=2", "-P", "system_len=8", "--num-requests", "4",
         "--request-rate", "50", "--timeout", "10", "--output", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Completed / failed requests:        0 / 4" in proc.stdout
    results = json.loads(out.read_text())
    summary = results["runs"][0]["summary"]
    assert (summary["completed"], summary["failed"]) == (0, 4)
    [(message, count)] = summary["errors"].items()
    assert message.startswith("ConnectError") and count == 4
    assert all(not r["ok"] and r["error"] == message for r in results["runs"][0]["requests"])
    assert summary["ttft_ms"]["p50"] is None and summary["request_throughput"] == 0


@pytest.mark.parametrize("args, message", [
    (["--workload", "tree", "-P", "samples=0"], "samples must be >= 1"),
    (["--workload", "tree", "-P", "bogus=1"], "no parameter 'bogus'"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--request-rate", "2", "--sweep-rates", "1,2"], "not both"),
    (["--compare", "a.json", "b.json", "--labels", "x"], "one name per --compare file"),
    (["--compare", "missing.json", "other.json"], "cannot read results"),
    (["--client-processes", "0"], "--client-processes must be >= 1"),
    (["--client-processes", "2", "--max-concurrency", "4"], "limits one client process"),
])
def test_invalid_arguments_exit_2(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--request-rate", "0"], ["--sweep-rates", "1,x"], ["-P", "novalue"]])
def test_argparse_rejects(args):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2


def fake_run(rate: float, ttft: float) -> report.Run:
    from radixrelay.bench.summary import SLO, summarize
    records = [record(ttft=ttft, e2e=ttft + 400.0), record(ttft=2 * ttft, e2e=2 * ttft + 400.0)]
    return report.make_run(rate, summarize(records, 1.0, SLO(ttft_ms=150.0)), records)


def test_summary_table_and_markdown():
    run = fake_run(2.0, 100.0)
    table = report.summary_table("few-shot @ 2 req/s", run["summary"])
    assert "few-shot @ 2 req/s" in table and "Completed / failed requests:        2 / 0" in table
    assert "Cached prompt tokens (hit ratio):   20 (50.0%)" in table
    assert "Goodput (req/s), SLO attainment:    1.00, 50.0%" in table
    assert "TTFT" in table and "150.00" in table            # the TTFT mean
    md = report.markdown_table([("a", run), ("b", fake_run(float("inf"), 50.0))])
    lines = md.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| a | 2.0 | 2 | 0 |") and "| b | inf |" in lines[3]


def test_compare_single_runs_and_sweeps(tmp_path):
    def write(name: str, runs: list[report.Run]) -> Path:
        path = tmp_path / name
        report.write_results(path, {"workload": "x"}, runs)
        return path

    pytest.importorskip("matplotlib")
    single_a, single_b = write("on.json", [fake_run(2.0, 100.0)]), write("off.json", [fake_run(2.0, 80.0)])
    assert main(["--compare", str(single_a), str(single_b), "--output", str(tmp_path / "bars")]) == 0
    assert (tmp_path / "bars.png").stat().st_size > 0
    assert "| on | 2.0 |" in (tmp_path / "bars.md").read_text()

    sweep = [fake_run(r, 100.0 * r) for r in (1.0, 2.0, 4.0)]
    a, b = write("a.json", sweep), write("b.json", sweep)
    assert main(["--compare", str(a), str(a), "--output", str(tmp_path / "same.png")]) == 2
    assert main(["--compare", str(a), str(b), "--output", str(tmp_path / "lines.png")]) == 0
    assert (tmp_path / "lines.png").stat().st_size > 0
    assert report.load_results(a)["runs"][2]["request_rate"] == 4.0
