"""CPU cost of the scheduler + radix tree + allocator as a function of the KV page size.

Workload: multi-turn chats over a few long shared system prompts (the prompt-sharing case the
project targets). A minimal worker returns fixed tokens, so the time measured is the scheduler's
own (match/insert/evict/lock, admission, page bookkeeping, plan building). Reported per page size:
scheduler microseconds per generated token and per step, and the prefix-hit rate (only whole pages
are shared, so larger pages lose up to page_size - 1 tokens per request).

    python -m benchmarks.engine.bench_radix_page_size [--requests 400]
"""

from __future__ import annotations

import argparse
import random
import time

from radixrelay.protocol.step import StepOutput, StepPlan
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig


def sampled_rids(plan: StepPlan) -> list[int]:
    return [e.rid for e in plan.extends if e.sample] + list(plan.decodes)


def run(page_size: int, num_requests: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(rng.randrange(500, 2000))] for _ in range(4)]
    cfg = SchedulerConfig(kv_cache_tokens=200_000, page_size=page_size,
                          max_running_requests=64, chunked_prefill_tokens=4096)
    sched = Scheduler(cfg)
    history: dict[int, list[int]] = {}
    rid = steps = generated = 0
    elapsed = 0.0
    while rid < num_requests or sched.has_work():
        while rid < num_requests and sched.stats().num_waiting < 16:
            chat = rid % 40
            turn = history.get(chat, rng.choice(systems))
            prompt = turn + [rng.randrange(32000) for _ in range(rng.randrange(20, 200))]
            history[chat] = prompt                  # next turn extends this conversation
            sched.add_request(rid, prompt, SamplingParams(max_tokens=rng.randrange(32, 256)))
            rid += 1
            if len(prompt) > 12_000:
                history.pop(chat)
        t0 = time.perf_counter()
        plan = sched.schedule()
        assert plan is not None
        rids = sampled_rids(plan)
        updates = sched.process_output(StepOutput(plan.step_id, rids, [7] * len(rids)))
        elapsed += time.perf_counter() - t0
        steps += 1
        generated += sum(len(u.token_ids) for u in updates)
    sched.check_integrity()
    stats = sched.stats()
    return {"us_per_token": 1e6 * elapsed / generated, "us_per_step": 1e6 * elapsed / steps,
            "hit_rate": stats.cache_hit_tokens / stats.prompt_tokens, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=5, help="best of N (shared CPUs are noisy)")
    args = parser.parse_args()
    print(f"{'page':>5} {'us/token':>9} {'us/step':>9} {'hit rate':>9} {'steps':>6}")
    for ps in args.page_sizes:
        r = min((run(ps, args.requests) for _ in range(args.repeats)),
                key=lambda x: x["us_per_token"])
        print(f"{ps:>5} {r['us_per_token']:>9.2f} {r['us_per_step']:>9.1f} "
              f"{r['hit_rate']:>9.4f} {r['steps']:>6}")


if __name__ == "__main__":
    main()
