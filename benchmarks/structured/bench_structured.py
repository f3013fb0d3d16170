"""Structured outputs' cost per decode step: a batch where a share of the requests is constrained
(a JSON schema with a long string field, and a regex, both compiled once in an untimed warm-up)
against the same batch with no constraint, side by side in one Engine.

Every request generates ``--max-tokens`` tokens (the unconstrained ones ignore EOS; the constraints
practically cannot end sooner: see ``ENDLESS``; any that do are counted), so both batches run the same
steps. Per round and mode: the batch
with ``--max-tokens`` and again with half of them (fresh prompts each time, so no prefix is cached):
the difference is decode steps alone. With ``--tools`` the constraints are forced tool calls (xgrammar
structural tags, as the server builds them). Reported: median decode step (TPOT) per mode over
``--repeats`` rounds, and the overhead of the constrained batch.

    python -m benchmarks.structured.bench_structured --device cpu --batch 64 --max-tokens 64
    python -m benchmarks.structured.bench_structured --device cuda --llama3-8b --batch 64    # dummy weights, GPU
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from radixrelay import Engine, SamplingParams
from radixrelay.structured import StructuredOutput

WORDS = ("river stone garden letter window market silver autumn engine harbor candle forest "
         "pocket ladder mirror thunder meadow anchor lantern velvet").split()


# Free text whose end needs the model to choose "ZQXJ" three times: the requests practically never end
# before max_tokens, and the grammars stay cheap. (A bounded repetition such as minLength 2048 would
# also keep them going, but xgrammar's accept_token costs ~0.3 ms per token inside one.)
ENDLESS = "[a-z ,.]+(ZQXJ[a-z ,.]+){3}"


def constraints() -> list[StructuredOutput]:
    """A JSON schema (an object with two strings, one of them free text) and a regex."""
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                               "story": {"type": "string", "pattern": f"^{ENDLESS}$"}},
              "required": ["title", "story"]}
    return [StructuredOutput.json_schema(schema), StructuredOutput.regex(ENDLESS)]


def tool_constraints() -> list[StructuredOutput]:
    """Forced tool calls as the server builds them (the hermes format): a named function, and
    ``required`` over 8 functions; arguments with a free-text field like ``constraints``'s."""
    from radixrelay.text.tool_calls import Function, constraint, get_format

    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "story": {"type": "string", "pattern": f"^{ENDLESS}$"}},
              "required": ["city", "story"]}
    fmt, functions = get_format("hermes"), [Function(f"tool_{i}", params) for i in range(8)]
    return [StructuredOutput.structural_tag(constraint(fmt, fns, "required", parallel=False, marker_is_text=True))
            for fns in (functions[:1], functions)]


def prompts(tag: str, n: int) -> list[str]:
    return [f"Request {tag}-{i}: write about the {WORDS[i % len(WORDS)]} and the {WORDS[(i * 7) % len(WORDS)]}."
            for i in range(n)]


def batch_params(n: int, share: float, max_tokens: int, specs: list[StructuredOutput]) -> list[SamplingParams]:
    """The first ``share`` of the batch constrained (alternating the specs), the rest free."""
    constrained = round(n * share)
    return [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, structured=specs[i % len(specs)])
            if i < constrained else SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
            for i in range(n)]


def timed(engine: Engine, texts: list[str], params: list[SamplingParams], early: list[int]) -> float:
    """Wall seconds of the batch; requests that ended before max_tokens are counted in ``early`` (the
    unconstrained ones never do, so the batch runs max_tokens steps either way)."""
    start = time.perf_counter()
    outs = engine.generate(texts, params)
    wall = time.perf_counter() - start
    early.append(sum(o.completion_tokens != p.max_tokens for o, p in zip(outs, params)))
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--llama3-8b", action="store_true", help="Llama-3-8B shapes, dummy bf16 weights, the "
                    "default model's tokenizer (GPU)")
    ap.add_argument("--tokenizer", default="default", help="with --llama3-8b: the tokenizer to serve")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--share", type=float, default=0.5, help="constrained share of the batch")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", type=Path, help="append the markdown result here")
    ap.add_argument("--tools", action="store_true", help="constrain with forced tool calls (structural tags) "
                    "instead of a JSON schema and a regex")
    args = ap.parse_args()

    options: dict = {"device": args.device, "kv_cache_tokens": args.batch * (args.max_tokens + 64) * 2}
    model = "default"
    if args.llama3_8b:
        from benchmarks.common import llama3_8b_dir

        model = str(llama3_8b_dir(Path(tempfile.mkdtemp()) / "llama3-8b-shapes", 32, 49152))
        options.update(load_format="dummy", tokenizer=args.tokenizer, dtype="bfloat16")
    specs = tool_constraints() if args.tools else constraints()
    early: list[int] = []
    half = args.max_tokens // 2
    steps: dict[str, list[float]] = {"none": [], "constrained": []}
    with Engine(model=model, **options) as engine:
        for mode, share in (("none", 0.0), ("constrained", args.share)):       # warm-up: compiles, graphs
            timed(engine, prompts(f"warm-{mode}", args.batch), batch_params(args.batch, share, args.max_tokens, specs),
                  [])
        for r in range(args.repeats):
            for mode, share in (("none", 0.0), ("constrained", args.share)):
                full = timed(engine, prompts(f"{r}-{mode}-full", args.batch),
                             batch_params(args.batch, share, args.max_tokens, specs), early)
                part = timed(engine, prompts(f"{r}-{mode}-half", args.batch),
                             batch_params(args.batch, share, half, specs), early)
                steps[mode].append((full - part) / (args.max_tokens - half))
    none, constrained = (statistics.median(steps[m]) * 1e3 for m in ("none", "constrained"))
    device = args.device
    if args.device.startswith("cuda"):
        import torch

        device = torch.cuda.get_device_name()
    model_name = "Llama-3-8B shapes, dummy bf16 weights" if args.llama3_8b else "SmolLM2-135M-Instruct (fp32)"
    what = "forced tool calls" if args.tools else "constrained"
    report = (f"## {device}: {model_name}, batch {args.batch}, {args.share:.0%} {what}\n\n"
              f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; `python -m benchmarks.structured.bench_structured "
              f"{' '.join(sys.argv[1:])}`; {os.cpu_count()} CPU cores ({platform.machine()})\n\n"
              f"| batch | decode step, no constraint (ms) | decode step, {args.share:.0%} constrained (ms) | overhead |\n"
              f"|---|---|---|---|\n"
              f"| {args.batch} | {none:.2f} | {constrained:.2f} | {constrained / none - 1:+.1%} |\n\n"
              f"Per round (ms): none {[round(s * 1e3, 2) for s in steps['none']]}, "
              f"constrained {[round(s * 1e3, 2) for s in steps['constrained']]}; requests that ended before "
              f"max_tokens: {sum(early)} of {len(early) * args.batch}\n")
    print(report)
    if args.output is not None:
        with args.output.open("a") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
