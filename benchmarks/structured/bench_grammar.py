"""CPU benchmark of the constrained-decoding grammar engines xgrammar and llguidance on the default
model's tokenizer (SmolLM2-135M-Instruct: byte-level BPE, 49,152 ids, EOS ``<|im_end|>`` = 2).

Workloads, the same for both: any JSON (xgrammar's builtin grammar, an object or an array; llguidance
the schema ``{"type": ["object", "array"]}``), a nested schema, a schema of 200 required properties, two
regexes and a choice among 5 strings (xgrammar EBNF, llguidance Lark); each with valid documents,
tokenized by ``tok.encode(text, add_special_tokens=False)``, then EOS. Measured per engine:
- compile (grammar spec -> matcher ready): cold without a compile cache (xgrammar on 1 thread;
  llguidance has none: ``grammar_from_*`` + ``LLMatcher()``), warm (xgrammar's cache hit, llguidance
  ``deep_copy()`` of a built matcher), and the first mask after a cold compile;
- per token: fill the next-token bitmask + accept the token along the documents (median, p99);
- batch: one step's masks for 32 matchers at staggered positions in all the documents, with the
  engine's threaded call (xgrammar ``BatchGrammarMatcher``, llguidance ``LLExecutor``) on 1 and on
  os.cpu_count() threads, vs a Python loop of single fills;
- agreement: at each step, whether both engines allow the same token ids; any refused token.

    python -m benchmarks.structured.bench_grammar [--repeats 7] [--output benchmarks/results/structured/grammar_engines.md]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance as llg
import llguidance.hf
import llguidance.numpy as llg_np
import numpy as np
import transformers
import xgrammar as xgr

from benchmarks.common import RESULTS, ROOT
from radixrelay.model.model_registry import resolve_model_path
from radixrelay.text.tokenizer import Tokenizer, load_tokenizer

BATCH = 32  # matchers per batched mask fill
BATCH_STEPS = 64  # steps timed per batch measurement, times --repeats
CHOICES = ["apple", "banana", "cherry", "date", "elderberry"]


@dataclass(frozen=True)
class Workload:
    name: str
    xgr: Callable[[xgr.GrammarCompiler], xgr.CompiledGrammar]
    llg: Callable[[], str]  # an llguidance grammar
    docs: tuple[str, ...]


def schema_workload(name: str, schema: dict[str, Any], doc: Any,
                    xgr_compile: Callable[[xgr.GrammarCompiler], xgr.CompiledGrammar] | None = None) -> Workload:
    """A JSON schema (compiled as such unless ``xgr_compile`` is given); ``doc`` pretty-printed and compact."""
    return Workload(name, xgr_compile or (lambda c: c.compile_json_schema(schema)),
                    lambda: llg.LLMatcher.grammar_from_json_schema(schema),
                    (json.dumps(doc, indent=2, ensure_ascii=False), json.dumps(doc, ensure_ascii=False)))


def regex_workload(name: str, regex: str, docs: tuple[str, ...]) -> Workload:
    return Workload(name, lambda c: c.compile_regex(regex), lambda: llg.LLMatcher.grammar_from_regex(regex), docs)


def workloads() -> list[Workload]:
    any_json = {"id": 12345, "name": 'Widget "Pro"', "price": -19.99, "ratio": 1.5e-3, "tags": ["a", "b"],
                "in_stock": True, "discontinued": False, "notes": None, "dims": {"w": 10, "h": 2.5, "unit": "cm"},
                "history": [{"date": "2024-01-02", "qty": 3}, {"date": "2024-02-03", "qty": 0}],
                "desc": "Ünïcödé ✓ and emoji 🚀"}
    address = {"type": "object", "additionalProperties": False, "required": ["street", "city"],
               "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                              "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}
    nested = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "tags", "address"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                             "role": {"enum": ["admin", "user", "guest"]},
                             "tags": {"type": "array", "items": {"type": "string"}},
                             "address": address, "nickname": {"type": "string"}}}
    person = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "poetry"],
              "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"}}
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}]
    props = {f"field_{i:03d}": kinds[i % 3] for i in range(200)}
    wide = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return [
        schema_workload("json (any)", {"type": ["object", "array"]}, any_json,
                        xgr.GrammarCompiler.compile_builtin_json_grammar),
        schema_workload("schema nested", nested, person),
        schema_workload("schema 200 props", wide, {k: [f"value {i}", i * 7 - 300, i % 2 == 0][i % 3]
                                                   for i, k in enumerate(props)}),
        regex_workload("regex phone", r"\d{3}-\d{3}-\d{4}", ("555-123-4567", "212-555-0199")),
        regex_workload("regex email", r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}",
                       ("jane.doe+news@example.co.uk", "x_y.z@mail-server.org")),
        Workload("choice of 5", lambda c: c.compile_grammar("root ::= " + " | ".join(f'"{s}"' for s in CHOICES)),
                 lambda: llg.LLMatcher.grammar_from_lark("start: " + " | ".join(f'"{s}"' for s in CHOICES)),
                 ("banana", "elderberry")),
    ]


@dataclass(frozen=True)
class Engine:
    """One grammar engine behind the calls the benchmark makes; a matcher is the engine's own object."""

    name: str
    cold_matcher: Callable[[Workload], Any]  # compiled without any cache
    warm_matcher: Callable[[Workload], Any]  # from the engine's cache / a copy of a built matcher
    fill: Callable[[Any, np.ndarray, int], Any]  # (matcher, bitmask, row)
    accept: Callable[[Any, int], bool]
    fill_batch: Callable[[list[Any], np.ndarray, int], None]  # (matchers, bitmask, threads)


def xgrammar_engine(info: xgr.TokenizerInfo, thread_counts: list[int]) -> Engine:
    cold = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    warm = xgr.GrammarCompiler(info, max_threads=1)
    pools = {n: xgr.BatchGrammarMatcher(max_threads=n) for n in thread_counts}
    return Engine("xgrammar", lambda w: xgr.GrammarMatcher(w.xgr(cold)), lambda w: xgr.GrammarMatcher(w.xgr(warm)),
                  lambda m, mask, row: m.fill_next_token_bitmask(mask, row), lambda m, token: m.accept_token(token),
                  lambda ms, mask, n: pools[n].batch_fill_next_token_bitmask(ms, mask))


def llguidance_engine(tok: Tokenizer, thread_counts: list[int]) -> Engine:
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._backend._tok, eos_token="<|im_end|>")
    lltok = llguidance.hf.from_tokenizer(fast)
    built: dict[str, llg.LLMatcher] = {}
    executors = {n: llg.LLExecutor(num_threads=n) for n in thread_counts}

    def cold(w: Workload) -> llg.LLMatcher:
        m = llg.LLMatcher(lltok, w.llg(), log_level=0)
        if m.is_error():
            raise RuntimeError(f"llguidance, {w.name}: {m.get_error()}")
        return m

    def warm(w: Workload) -> llg.LLMatcher:
        if w.name not in built:
            built[w.name] = cold(w)
        return built[w.name].deep_copy()

    def fill_batch(ms: list[llg.LLMatcher], mask: np.ndarray, threads: int) -> None:
        llg_np.fill_next_token_bitmask_par(executors[threads], [(m, i) for i, m in enumerate(ms)], mask)

    return Engine("llguidance", cold, warm, llg_np.fill_next_token_bitmask, lambda m, token: m.consume_token(token),
                  fill_batch)


Lane = tuple[Workload, list[int]]  # a grammar and the tokens of one valid document


@dataclass
class Figures:
    cold_ms: float
    warm_us: float
    first_mask_us: float
    token_us: float  # fill + accept, median
    token_p99_us: float


def new_mask(rows: int, vocab: int) -> np.ndarray:
    return np.full((rows, (vocab + 31) // 32), -1, dtype=np.int32)


def timed_ns(fn: Callable[[], Any]) -> int:
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


def walk(e: Engine, w: Workload, ids: list[int], vocab: int, refusals: list[str]) -> list[int]:
    """Fill + accept along ``ids``; nanoseconds per step (a refused token ends the walk)."""
    m, mask, times = e.warm_matcher(w), new_mask(1, vocab), []
    for step, token in enumerate(ids):
        t0 = time.perf_counter_ns()
        e.fill(m, mask, 0)
        ok = e.accept(m, token)
        times.append(time.perf_counter_ns() - t0)
        if not ok:
            refusals.append(f"{e.name} refused token {step} ({token}) of a {w.name} document")
            break
    return times


def batch_us(e: Engine, lanes: list[Lane], vocab: int, threads: int, steps: int) -> tuple[float, float]:
    """Median µs per step to fill the masks of all lanes' matchers: (engine's batched call, Python loop).
    Two matcher sets walk in step, one per method, timed alternately within each step (so both see the
    same load; a set of its own each, as llguidance serves a repeated fill of a matcher from a cache).
    Lane i starts i/len(lanes) of the way into its document and starts over at its end."""
    masks = [new_mask(len(lanes), vocab) for _ in range(2)]
    times: tuple[list[int], list[int]] = ([], [])
    sets = [[e.warm_matcher(w) for w, _ in lanes] for _ in range(2)]
    pos = [i * len(ids) // len(lanes) for i, (_, ids) in enumerate(lanes)]
    for i, (_, ids) in enumerate(lanes):
        for token in ids[:pos[i]]:
            for ms in sets:
                e.accept(ms[i], token)
    fills = [lambda ms, mask: e.fill_batch(ms, mask, threads),
             lambda ms, mask: [e.fill(m, mask, i) for i, m in enumerate(ms)]]
    for step in range(steps):
        for which in (0, 1) if step % 2 else (1, 0):
            times[which].append(timed_ns(lambda: fills[which](sets[which], masks[which])))
        for i, (w, ids) in enumerate(lanes):
            for ms in sets:
                e.accept(ms[i], ids[pos[i]])
            pos[i] = (pos[i] + 1) % len(ids)
            if pos[i] == 0:
                for ms in sets:
                    ms[i] = e.warm_matcher(w)
    return statistics.median(times[0]) / 1e3, statistics.median(times[1]) / 1e3


def measure(e: Engine, w: Workload, docs: list[list[int]], vocab: int, repeats: int, refusals: list[str]) -> Figures:
    cold = statistics.median(timed_ns(lambda: e.cold_matcher(w)) for _ in range(repeats)) / 1e6
    e.warm_matcher(w)  # fill xgrammar's cache / build the matcher that llguidance copies
    warm = statistics.median(timed_ns(lambda: e.warm_matcher(w)) for _ in range(repeats)) / 1e3
    mask, cold_matchers = new_mask(1, vocab), [e.cold_matcher(w) for _ in range(repeats)]
    first = statistics.median(timed_ns(lambda: e.fill(m, mask, 0)) for m in cold_matchers) / 1e3
    steps = [t for ids in docs for _ in range(repeats) for t in walk(e, w, ids, vocab, refusals)]
    return Figures(cold, warm, first, statistics.median(steps) / 1e3, float(np.percentile(steps, 99)) / 1e3)


def agreement(engines: list[Engine], w: Workload, ids: list[int], vocab: int, label: Callable[[int], str],
              differ_at: list[int], only: Counter[str]) -> int:
    """Walks both engines in step. Returns the number of steps whose allowed-id sets are identical; appends
    the number of differing ids at each other step to ``differ_at`` and counts them in ``only``."""
    ms, masks, same = [e.warm_matcher(w) for e in engines], [new_mask(1, vocab) for _ in engines], 0
    for token in ids:
        for e, m, mask in zip(engines, ms, masks):
            e.fill(m, mask, 0)
        bits = [np.unpackbits(mask[0].view(np.uint8), bitorder="little") for mask in masks]
        differ = np.flatnonzero(bits[0] != bits[1])
        same += differ.size == 0
        if differ.size:
            differ_at.append(int(differ.size))
            only.update(f"{label(int(i))} only {engines[int(bits[1][i])].name}" for i in differ)
        if not all([e.accept(m, token) for e, m in zip(engines, ms)]):
            break
    return same


def md_table(header: list[str], rows: list[list[str]], align: str) -> str:
    """``align``: one letter per column, l or r."""
    rule = ["---:" if a == "r" else "---" for a in align]
    return "\n".join("| " + " | ".join(r) + " |" for r in [header, rule, *rows])


def findings(figs: list[dict[str, Figures]], mixed: dict[tuple[str, int], tuple[float, float]],
             same: int, total: int, only: Counter[str], refusals: list[str]) -> list[str]:
    x, g = [f["xgrammar"] for f in figs], [f["llguidance"] for f in figs]

    def faster(attr: str) -> str:  # geometric mean over the workloads of llguidance / xgrammar
        r = float(np.exp(np.mean([np.log(getattr(b, attr) / getattr(a, attr)) for a, b in zip(x, g)])))
        return f"xgrammar is {r:.1f}x faster" if r > 1 else f"llguidance is {1 / r:.1f}x faster"

    def span(fs: list[Figures], attr: str, fmt: str) -> str:
        low, high = (f"{v(getattr(f, attr) for f in fs):{fmt}}" for v in (min, max))
        return low if low == high else f"{low}-{high}"

    return [
        f"- Cold compile: {faster('cold_ms')} (geometric mean over the workloads; xgrammar "
        f"{span(x, 'cold_ms', '.2f')} ms on 1 thread, llguidance {span(g, 'cold_ms', '.2f')} ms). xgrammar "
        f"precomputes token masks when compiling, llguidance works lazily: its first mask takes "
        f"{span(g, 'first_mask_us', '.0f')} µs, xgrammar's {span(x, 'first_mask_us', '.0f')} µs. Warm: "
        f"xgrammar's cache hit {span(x, 'warm_us', '.0f')} µs, llguidance's deep_copy() "
        f"{span(g, 'warm_us', '.0f')} µs.",
        f"- Per token (fill + accept): {faster('token_us')} (geometric mean of the medians; xgrammar "
        f"{span(x, 'token_us', '.1f')} µs, llguidance {span(g, 'token_us', '.1f')} µs; p99 up to "
        f"{max(f.token_p99_us for f in x):.0f} and {max(f.token_p99_us for f in g):.0f} µs).",
        f"- {BATCH} matchers over all workloads, one step's masks, batched vs a Python loop: " + "; ".join(
            f"{e} on {n} thread{'s' * (n > 1)} {b:.0f} vs {lp:.0f} µs" for (e, n), (b, lp) in mixed.items()) + ".",
        f"- Agreement: identical allowed-token sets at {same} of {total} steps; the most frequent differences: "
        + ", ".join(f"{k} ({n} steps)" for k, n in only.most_common(4)) + ".",
        "- Refusals: " + ("none; both engines accepted every token of every document, EOS included."
                          if not refusals else "; ".join(refusals)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="runs per measurement (medians)")
    ap.add_argument("--output", default=str(RESULTS / "structured" / "grammar_engines.md"))
    args = ap.parse_args()
    load_start, cores = os.getloadavg(), os.cpu_count() or 1
    thread_counts = sorted({1, cores})

    tok = load_tokenizer(resolve_model_path("default"))
    eos, vocab = min(tok.eos_token_ids), tok.vocab_size
    vocab_strs = ["" if i in tok.special_token_ids else tok._backend.id_to_token(i) for i in range(vocab)]
    info = xgr.TokenizerInfo(vocab_strs, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab,
                             stop_token_ids=sorted(tok.eos_token_ids))  # special ids are "": never allowed
    engines = [xgrammar_engine(info, thread_counts), llguidance_engine(tok, thread_counts)]
    decoded = info.decoded_vocab

    def label(i: int) -> str:  # a token's bytes, or the special token's name
        return repr(decoded[i]) if decoded[i] else tok.convert_ids_to_tokens([i])[0]

    refusals: list[str] = []
    figs: list[dict[str, Figures]] = []
    lanes: list[Lane] = []
    rows, agree_rows, same_all, total_all, only_all = [], [], 0, 0, Counter()
    for w in workloads():
        docs = [tok.encode(d, add_special_tokens=False) + [eos] for d in w.docs]
        lanes += [(w, ids) for ids in docs]
        figs.append({e.name: measure(e, w, docs, vocab, args.repeats, refusals) for e in engines})
        rows += [[w.name, e, str(sum(map(len, docs))), f"{f.cold_ms:.2f}", f"{f.warm_us:.0f}",
                  f"{f.first_mask_us:.0f}", f"{f.token_us:.1f}", f"{f.token_p99_us:.1f}"] for e, f in figs[-1].items()]
        differ_at: list[int] = []
        only: Counter[str] = Counter()
        same = sum(agreement(engines, w, ids, vocab, label, differ_at, only) for ids in docs)
        same_all, total_all, only_all = same_all + same, total_all + same + len(differ_at), only_all + only
        agree_rows.append([w.name, f"{same}/{same + len(differ_at)}", str(max(differ_at, default=0)),
                           "; ".join(f"{k} ({n})" for k, n in only.most_common(3)).replace("|", "\\|") or "-"])
    mixed_lanes = [lanes[i % len(lanes)] for i in range(BATCH)]
    steps = BATCH_STEPS * args.repeats
    mixed = {(e.name, n): batch_us(e, mixed_lanes, vocab, n, steps) for n in thread_counts for e in engines}

    tables = [
        "## Compile and per-token cost\n\n" + md_table(
            ["workload", "engine", "tokens", "cold compile ms", "warm µs", "first mask µs", "per token µs (median)",
             "per token µs (p99)"], rows, "llrrrrrr"),
        f"## Masks for {BATCH} matchers at staggered positions in all workloads' documents, one step (µs)\n\n"
        f"Threaded calls need idle cores: on a busy machine (load average {load_start[0]:.2f} on {cores} cores at "
        f"the start) these figures move from run to run.\n\n" + md_table(
            ["engine", "threads", "batch fill", "loop of fills", "loop / batch"],
            [[e, str(n), f"{b:.0f}", f"{lp:.0f}", f"{lp / b:.2f}x"] for (e, n), (b, lp) in mixed.items()], "lrrrr"),
        "## Agreement of the allowed-token sets, both engines walked in step\n\n" + md_table(
            ["workload", "identical steps", "max ids differing", "most frequent differences (steps)"],
            agree_rows, "lrrl"),
    ]
    python = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT) + os.sep) else "python"
    command = " ".join([python, "-m", "benchmarks.structured.bench_grammar", *sys.argv[1:]])
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("xgrammar", "llguidance", "tokenizers"))
    report = "\n".join([
        "# Grammar engines on the CPU: xgrammar vs llguidance", "",
        f"- command: `{command}`",
        f"- machine: {cores} cores, {platform.platform()}, Python {platform.python_version()}; load average "
        f"{load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end",
        f"- versions: {versions}",
        f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}",
        f"- tokenizer: the default model's (SmolLM2-135M-Instruct), {vocab} ids; every document ends with EOS "
        f"({eos}). Medians of {args.repeats} runs (batch: of {steps} steps). Cold: "
        f"no compile cache, xgrammar on 1 thread; warm: xgrammar's cache hit, llguidance deep_copy() of a built "
        f"matcher (it has no compile cache). Per token: fill the next-token bitmask + accept the token.",
        "", "\n\n".join(tables), "", "## Findings", "",
        *findings(figs, mixed, same_all, total_all, only_all, refusals), "",
    ])
    print(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()
