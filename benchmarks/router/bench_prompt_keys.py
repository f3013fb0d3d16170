"""The router's per-request prompt work by prompt length, in this process (CPU is enough): a new question
over a document the replicas hold, as a completions body of token ids and as a chat body of text.

- ``parse``: the JSON body (``json.loads``, as the router's proxy does);
- ``prompt``: ``PromptKeys.prompt``: the ids checked (token ids) or the chat template and the tokenizer
  (text; the document's text was tokenized before, so the tokenizer's cache holds it);
- ``approximate keys``: ``PromptKeys.keys_of`` (the approximate index's keys);
- ``precise lookup``: ``KVEventIndex.matched_tokens_many`` over two replicas of one layout (16-token pages)
  that hold the document's pages, by their content keys (as their KV events told).

Median milliseconds over ``--repeats`` questions, each new.

    .venv/bin/python -m benchmarks.router.bench_prompt_keys --lengths 2000,30000,112000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from radixrelay.bench.words import WORDS

REPLICA_PS = 16
NAMESPACE = "bench/layout"


class _NoStore:
    def close(self) -> None:
        pass


def _index(keys: list[bytes]):
    from radixrelay.router import kv_index

    real = kv_index.connect
    kv_index.connect = lambda url, password=None: _NoStore()
    try:
        index = kv_index.KVEventIndex("redis://127.0.0.1:1")
    finally:
        kv_index.connect = real
    for name in ("http://a:1", "http://b:1"):
        index.replicas[name] = kv_index.ReplicaHoldings(namespace=NAMESPACE, page_size=REPLICA_PS, keys=set(keys))
    return index


def run(lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    from radixrelay.model.model_registry import resolve_model_path
    from radixrelay.radix.page_keys import chain_seed, extend_keys
    from radixrelay.router.prompt import PromptKeys
    from radixrelay.text.chat_template import ChatTemplate
    from radixrelay.text.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path("default"))
    keys = PromptKeys(tok, ChatTemplate.for_tokenizer(tok))
    rows = []
    for k, n in enumerate(lengths):
        rng = np.random.default_rng([3, k])
        for kind in ("token ids", "text"):
            if kind == "token ids":
                doc = rng.integers(0, tok.vocab_size, n).tolist()

                def body(doc=doc) -> bytes:
                    return json.dumps({"model": "m", "prompt": doc + rng.integers(0, tok.vocab_size, 24).tolist(),
                                       "max_tokens": 1}).encode()
                endpoint, ids = "completions", doc
            else:
                text = " ".join(rng.choice(WORDS, n))

                def body(text=text) -> bytes:
                    question = " ".join(rng.choice(WORDS, 12))
                    return json.dumps({"model": "m", "messages": [{"role": "user", "content": f"{text} {question}"}],
                                       "max_tokens": 1}).encode()
                endpoint = "chat"
                ids = list(map(int, keys.prompt(endpoint, json.loads(body())).token_ids))    # warms the tokenizer
            index = _index(extend_keys([], chain_seed(NAMESPACE, None), ids, REPLICA_PS, len(ids) // REPLICA_PS))
            index.matched_tokens_many(["http://a:1", "http://b:1"], ids, None)                 # a first question
            times: dict[str, list[float]] = {"parse": [], "prompt": [], "approximate keys": [], "precise lookup": []}
            matched = 0
            for _ in range(repeats):
                raw = body()
                t0 = time.perf_counter()
                parsed = json.loads(raw)
                t1 = time.perf_counter()
                prompt = keys.prompt(endpoint, parsed)
                t2 = time.perf_counter()
                keys.keys_of(prompt)
                t3 = time.perf_counter()
                matched = index.matched_tokens_many(["http://a:1", "http://b:1"], prompt.token_ids, None)[0]
                t4 = time.perf_counter()
                for key, a, b in zip(times, (t0, t1, t2, t3), (t1, t2, t3, t4)):
                    times[key].append((b - a) * 1e3)
            row: dict[str, Any] = {"kind": kind, "prompt_tokens": len(prompt.token_ids), "matched": matched}
            row.update({key: statistics.median(v) for key, v in times.items()})
            row["total"] = sum(row[key] for key in times)
            rows.append(row)
            print(f"  {kind:9s} {row['prompt_tokens']:7d} tokens (replicas hold {matched}): " + ", ".join(
                f"{key} {v:.3f}" for key, v in row.items() if isinstance(v, float)), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2000,30000,112000", help="document lengths in tokens (token ids) / words")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    print("router prompt work (ms, median; a new question over a document the replicas hold)")
    rows = run([int(x) for x in args.lengths.split(",")], args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
