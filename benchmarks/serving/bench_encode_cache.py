"""Tokenizing a cached long prompt on the CPU: the encode cache with reuse by prefix against chunks only.

For each prompt length (2K / 30K / 112K tokens of the default model's tokenizer) a chat prompt (the
default chat template over one user message: a document of random words, then a question) is
encoded once by each encoder, then these are timed (median milliseconds of --repeats; the encoders
take turns call by call, so that they run under the same load; every text but ``same``'s is new to
the encoder):

- ``same``: the same prompt again (all of it cached);
- ``new question``: the document with another question each time (what many questions over one
  document send);
- ``next turn``: the conversation with the model's answer and a new question after it, turn after
  turn (each prompt extends the one before);
- ``cold``: the prompt with nothing cached (the encoder cleared first; fewer repeats);
- ``burst of T``: T threads (a pool) each encoding the document with its own question at once
  (``encode`` or ``encode_array``), wall time of the burst.

``same`` and ``new question`` are timed through three calls: ``encode_array`` (the ids packed, no
Python int per id), ``encode`` (a list) and ``parts`` gathered into one list (what
``Tokenizer.encode(text, max_tokens=n)``, the server's path, does). Three encoders: ``before``
(``radixrelay/text/encode_cache.py`` as it was at --before, loaded from git: ~1 KB chunks cached by
their text), ``chunks`` (today's with ``max_prefix_bytes=0``: chunks only) and ``prefix`` (the
default: the longest remembered prefix's ids, then chunks).

    .venv/bin/python -m benchmarks.serving.bench_encode_cache
    .venv/bin/python -m benchmarks.serving.bench_encode_cache --lengths 2000,30000,112000 --repeats 21 --threads 8,32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import ROOT, default_tokenizer
from radixrelay.bench.words import WORDS

BEFORE = "c252713"                         # the last commit before reuse by prefix


def encoders(before: str | None) -> dict[str, Callable[[Any], Any]]:
    """Encoder factories by mode name."""
    from radixrelay.text.encode_cache import ChunkedEncoder

    modes: dict[str, Callable[[Any], Any]] = {}
    if before:
        source = subprocess.run(["git", "show", f"{before}:radixrelay/text/encode_cache.py"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout
        old = types.ModuleType("encode_cache_before")
        exec(compile(source, f"encode_cache.py@{before}", "exec"), old.__dict__)
        modes["before"] = old.ChunkedEncoder
    modes["chunks"] = lambda tok: ChunkedEncoder(tok, max_prefix_bytes=0)
    modes["prefix"] = ChunkedEncoder
    return modes


def run(lengths: list[int], repeats: int, threads: list[int], before: str | None) -> list[dict[str, Any]]:
    from radixrelay.model.model_registry import resolve_model_path
    from radixrelay.text.chat_template import ChatTemplate
    from radixrelay.text.tokenizer import load_tokenizer

    modes = encoders(before)
    name = default_tokenizer()
    tok = load_tokenizer(resolve_model_path(name) if name == "default" else name)
    hf = tok._backend._tok
    template = ChatTemplate.for_tokenizer(tok)
    pool = ThreadPoolExecutor(max(threads))
    rows = []
    for k, n in enumerate(lengths):
        rng = np.random.default_rng([7, k])
        doc = " ".join(rng.choice(WORDS, n))
        answer = " ".join(rng.choice(WORDS, 60))

        def question(i: int) -> str:
            return f"Question {i}: " + " ".join(np.random.default_rng([8, k, i]).choice(WORDS, 12)) + "?"

        def prompt(i: int) -> str:
            return template.render([{"role": "user", "content": f"{doc}\n\n{question(i)}"}])

        def turn(i: int) -> str:
            """The conversation after i answers (each turn extends the one before)."""
            messages = [{"role": "user", "content": f"{doc}\n\n{question(0)}"}]
            for j in range(i):
                messages += [{"role": "assistant", "content": f"{answer} ({j})"},
                             {"role": "user", "content": question(10_000 + j)}]
            return template.render(messages)

        first = prompt(0)
        want = hf.encode(first, add_special_tokens=False).ids
        encs = {mode: make(hf) for mode, make in modes.items()}
        for enc in encs.values():
            assert enc.encode(first) == want
        times: dict[tuple[str, str], list[float]] = {}

        def timed(key: str, texts: Callable[[int], Any], call: Callable[[Any, Any], Any], count: int,
                  needs: str | None = None, before_each: Callable[[Any], Any] | None = None) -> None:
            """``call(enc, texts(i))`` for i < count, the encoders taking turns (same load for each)."""
            for i in range(count):
                arg = texts(i)
                for mode, enc in encs.items():
                    if needs and not hasattr(enc, needs):
                        continue
                    if before_each:
                        before_each(enc)
                    start = time.perf_counter()
                    call(enc, arg)
                    times.setdefault((mode, key), []).append(time.perf_counter() - start)

        timed("same: encode_array", lambda i: first, lambda e, t: e.encode_array(t), repeats, "encode_array")
        timed("same: encode", lambda i: first, lambda e, t: e.encode(t), repeats)
        timed("same: parts", lambda i: first, lambda e, t: _gather(e.parts(t)), repeats)
        timed("new question: encode_array", lambda i: prompt(1 + i), lambda e, t: e.encode_array(t), repeats,
              "encode_array")
        timed("new question: encode", lambda i: prompt(1 + repeats + i), lambda e, t: e.encode(t), repeats)
        timed("new question: parts", lambda i: prompt(1 + 2 * repeats + i), lambda e, t: _gather(e.parts(t)), repeats)
        timed("next turn: encode", lambda i: turn(1 + i), lambda e, t: e.encode(t), repeats)
        base = 1 + 3 * repeats + repeats
        bursts = max(3, repeats // 2)
        for size in threads:
            for call in ("encode", "encode_array"):
                timed(f"burst of {size}: {call}, wall",
                      lambda i: [prompt(base + i * size + j) for j in range(size)],
                      lambda e, ts: list(pool.map(getattr(e, call), ts)), bursts, call)
                base += bursts * size
        timed("cold: encode", lambda i: first, lambda e, t: e.encode(t), max(3, repeats // 4),
              before_each=lambda e: e.clear())
        for mode, enc in encs.items():
            row: dict[str, Any] = {"tokens": len(want), "chars": len(first), "mode": mode}
            for (m, key), ts in times.items():
                if m == mode:
                    row[key] = statistics.median(ts) * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _gather(parts) -> list[int]:
    ids: list[int] = []
    for part in parts:
        ids.extend(part)
    return ids


def print_table(rows: list[dict[str, Any]]) -> None:
    keys = max(([k for k in r if ":" in k] for r in rows), key=len)
    print("\n| tokens | encoder | " + " | ".join(keys) + " |")
    print("|---:|---|" + "---:|" * len(keys))
    for r in rows:
        cells = " | ".join(f"{r[k]:.3f}" if k in r else "-" for k in keys)
        print(f"| {r['tokens']:,} | {r['mode']} | {cells} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2000,30000,112000", help="document lengths in words (~tokens)")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", default="8,32", help="requests in a burst, one burst size or several")
    p.add_argument("--before", default=BEFORE, help="the commit whose encoder is 'before' ('': none)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    rows = run([int(x) for x in args.lengths.split(",")], args.repeats,
               [int(x) for x in args.threads.split(",")], args.before or None)
    print_table(rows)
    print(f"\nload average {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
