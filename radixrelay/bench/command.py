"""Serving benchmark for radixrelay and any OpenAI-compatible server (vLLM, SGLang).

Runs a generated workload at a Poisson request rate (or a sweep of rates), prints a summary table,
and writes every figure plus per-request details to a JSON file; a sweep also writes a PNG plot and
a markdown table next to it. ``--compare`` plots earlier results files side by side.
Exit status: 0, or 1 when some run completed no request at all (the JSON is written either way),
2 for invalid arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from radixrelay.bench import plots, report
from radixrelay.bench.arrivals import arrival_times
from radixrelay.bench.http_client import BenchClient, ClientConfig, served_model
from radixrelay.bench.summary import SLO, summarize
from radixrelay.bench.runner import TokenCounter, run_sessions, run_sessions_parallel, token_counter
from radixrelay.bench.workloads import WORKLOADS, Workload, describe_workloads, make_workload

# Independent seeded random streams, keyed [seed, run index, stream]: each run's workload text and
# arrival times, and the warm-up text (which shares nothing with the measured requests).
_TEXT, _ARRIVALS, _WARMUP = 0, 1, 2


def _rng(seed: int, run: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, run, stream])


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(part) for part in text.split(",") if part.strip()]


def _param(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_serving.py", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="workloads and their parameters (--param KEY=VALUE; lengths in tokens):\n"
               + describe_workloads())
    p.add_argument("--base-url", default="http://127.0.0.1:30000",
                   help="server root, without /v1 (default: %(default)s)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions or /v1/completions (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the first one GET /v1/models lists)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="shared-prefix")
    p.add_argument("--param", "-P", type=_param, action="append", default=[], metavar="KEY=VALUE",
                   help="a workload parameter, repeatable (see below)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests to send (default: the workload's natural size)")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="Poisson arrival rate in requests/s (multi-turn: sessions/s); inf sends "
                        "all at once (default: inf)")
    p.add_argument("--sweep-rates", type=_rates, default=None, metavar="R1,R2,...",
                   help="run once per rate, each with its own seeded text; also writes a PNG and a "
                        "markdown table next to --output")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight; later arrivals wait (default: no limit)")
    p.add_argument("--client-processes", type=int, default=1,
                   help="client processes sharing the arrival schedule; at high rates one process's own "
                        "CPU limits the load it offers (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seeds workload text and arrivals (default: 0)")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="unmeasured requests sent first, with unrelated text (default: 0)")
    p.add_argument("--disable-stream", action="store_true",
                   help="non-streaming requests (TTFT then equals E2E latency)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly max_tokens output tokens (vLLM/SGLang/radixrelay extension)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="HTTP timeout in seconds, to connect and for each read (default: %(default)s)")
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in ms, for goodput")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in ms, for goodput")
    p.add_argument("--tokenizer", default=None,
                   help="count tokens with this tokenizer ('default', a HF directory or .gguf) when "
                        "the server reports no usage (default: a word-based estimate)")
    p.add_argument("--output", type=Path, default=Path("results.json"),
                   help="results JSON; with --compare, the PNG to write (default: %(default)s)")
    p.add_argument("--compare", nargs="+", type=Path, default=None, metavar="RESULTS_JSON",
                   help="plot these results files side by side instead of benchmarking")
    p.add_argument("--labels", nargs="+", default=None, help="names of the --compare files")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.seed < 0:
        raise ValueError("--seed must be >= 0")
    positive = {"--num-requests": args.num_requests, "--max-concurrency": args.max_concurrency}
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1")
    if args.client_processes < 1:
        raise ValueError("--client-processes must be >= 1")
    if args.client_processes > 1 and args.max_concurrency is not None:
        raise ValueError("--max-concurrency limits one client process: use it with --client-processes 1")
    if args.warmup_requests < 0 or args.timeout <= 0:
        raise ValueError("--warmup-requests must be >= 0 and --timeout > 0")
    if args.compare is not None and args.labels is not None and len(args.labels) != len(args.compare):
        raise ValueError("--labels needs one name per --compare file")
    if args.sweep_rates == []:
        raise ValueError("--sweep-rates needs at least one rate")
    if args.sweep_rates and not math.isinf(args.request_rate):
        raise ValueError("give --request-rate or --sweep-rates, not both")


async def _benchmark(args: argparse.Namespace, workload: Workload, num_requests: int,
                     rates: list[float], counter: TokenCounter) -> tuple[str, list[report.Run]]:
    model = args.model or await served_model(args.base_url, args.api_key) or "default"
    config = ClientConfig(base_url=args.base_url, endpoint=args.endpoint, model=model,
                          api_key=args.api_key, stream=not args.disable_stream,
                          temperature=args.temperature, ignore_eos=args.ignore_eos,
                          timeout=args.timeout)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    runs = []
    async with BenchClient(config) as client:
        if args.warmup_requests:
            warm = workload.generate(args.warmup_requests, _rng(args.seed, 0, _WARMUP))
            result = await run_sessions(client, warm, np.zeros(len(warm)), counter=counter,
                                        max_concurrency=args.max_concurrency, desc="warm-up")
            failed = sum(not r.ok for r in result.records)
            if failed:
                print(f"warm-up: {failed} of {len(result.records)} requests failed", file=sys.stderr)
        for index, rate in enumerate(rates):
            sessions = workload.generate(num_requests, _rng(args.seed, index, _TEXT))
            arrivals = arrival_times(len(sessions), rate, _rng(args.seed, index, _ARRIVALS))
            if args.client_processes > 1:
                result = await run_sessions_parallel(config, sessions, arrivals, processes=args.client_processes,
                                                     counter=counter, desc=f"rate {rate:g}")
            else:
                result = await run_sessions(client, sessions, arrivals, counter=counter,
                                            max_concurrency=args.max_concurrency, desc=f"rate {rate:g}")
            summary = summarize(result.records, result.duration_s, slo)
            runs.append(report.make_run(rate, summary, result.records))
            print(report.summary_table(f"{args.workload} @ {rate:g} req/s", summary))
    return model, runs


def _run_benchmark(args: argparse.Namespace) -> int:
    params = dict(args.param)
    workload = make_workload(args.workload, params)
    num_requests = args.num_requests or workload.natural_size()
    rates = args.sweep_rates or [args.request_rate]
    counter = token_counter(args.tokenizer)
    model, runs = asyncio.run(_benchmark(args, workload, num_requests, rates, counter))
    config: dict[str, Any] = {
        "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
        "workload": args.workload,
        "workload_params": dataclasses.asdict(workload),  # type: ignore[call-overload]
        "num_requests": num_requests, "request_rates": [r["request_rate"] for r in runs],
        "max_concurrency": args.max_concurrency, "client_processes": args.client_processes, "seed": args.seed,
        "warmup_requests": args.warmup_requests, "stream": not args.disable_stream,
        "temperature": args.temperature, "ignore_eos": args.ignore_eos,
        "slo_ttft_ms": args.slo_ttft, "slo_tpot_ms": args.slo_tpot, "token_counter": counter.name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    report.write_results(args.output, config, runs)
    print(f"results: {args.output}")
    if args.sweep_rates:
        table = report.markdown_table([(args.workload, run) for run in runs])
        args.output.with_suffix(".md").write_text(table, encoding="utf-8")
        plots.plot_rates({args.workload: runs}, args.output.with_suffix(".png"),
                         f"{args.workload}, {model}")
        print(table + f"plot: {args.output.with_suffix('.png')}")
    return 0 if all(run["summary"]["completed"] for run in runs) else 1


def _run_compare(args: argparse.Namespace) -> int:
    files = [report.load_results(path) for path in args.compare]
    labels = args.labels or [path.stem for path in args.compare]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--compare needs distinct labels, got {labels}: give --labels")
    png = args.output if args.output.suffix == ".png" else args.output.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    if all(len(data["runs"]) > 1 for data in files):
        plots.plot_rates({label: data["runs"] for label, data in zip(labels, files)}, png,
                         " vs ".join(labels))
    else:
        plots.plot_bars({label: data["runs"][0] for label, data in zip(labels, files)}, png,
                        " vs ".join(labels))
    table = report.markdown_table([(label, run) for label, data in zip(labels, files)
                                   for run in data["runs"]])
    png.with_suffix(".md").write_text(table, encoding="utf-8")
    print(table + f"plot: {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        _check(args)
        return _run_compare(args) if args.compare else _run_benchmark(args)
    except (ValueError, RuntimeError) as exc:
        print(f"bench_serving: error: {exc}", file=sys.stderr)
        return 2
