"""A two-level tree of thought: 3 first steps, each expanded into 2 second steps; every leaf is
rated by the model and the best-rated path is printed.

Every branch sends its full text: the server's radix tree shares the root among all 6 leaves and
each first step among its 2 children, with no prefix annotations.
"""

from __future__ import annotations

import argparse
import re

import radixrelay.lang as rl
from common import main

PROBLEM = "Plan a one-day trip to a city you have never visited, on a small budget."


@rl.function
def tree_of_thought(s, problem: str, width: int, depth2: int):
    s += rl.system("You solve problems in short numbered steps.")
    s += rl.user(problem)
    s += rl.assistant_begin()           # the steps and forks below are one assistant turn
    s += "Step 1:"
    level1 = s.fork(width)
    for f in level1:
        f += rl.gen("step1", max_tokens=32, temperature=0.9, stop="\n")
        f += "\nStep 2:"
    leaves = []
    for f in level1:
        level2 = f.fork(depth2)
        for g in level2:
            g += rl.gen("step2", max_tokens=32, temperature=0.9, stop="\n")
            g += "\nOn a scale of 1 to 10, this plan is rated "
            g += rl.gen("rating", max_tokens=3, temperature=0)
        leaves.extend(level2)
    ranked = sorted(leaves, key=lambda g: _score(g["rating"]), reverse=True)
    for g in ranked:
        print(f"[{_score(g['rating'])}] 1:{g['step1'].strip()} | 2:{g['step2'].strip()}")
    best = ranked[0]
    s += f"{best['step1']}\nStep 2:{best['step2']}"   # the root keeps the best path
    s += rl.assistant_end()


def _score(text: str) -> int:
    match = re.search(r"\d+", text)
    return int(match.group()) if match else 0


def run(args: argparse.Namespace) -> None:
    state = tree_of_thought.run(problem=args.problem, width=3, depth2=2)
    print(state.text())


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--problem", default=PROBLEM)


if __name__ == "__main__":
    main(__doc__.splitlines()[0], run, add_args)
