"""Self-consistency: sample 8 reasoning paths from one prompt, answer by majority vote.

The 8 branches share the question's tokens; the server computes them once (radix cache), and the
branches decode together.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import radixrelay.lang as rl
from common import main

QUESTION = "Tom has 3 boxes with 4 apples in each box. He eats 2 apples. How many apples are left?"


@rl.function
def self_consistency(s, question: str, paths: int):
    s += rl.system("You are a careful math tutor. Think step by step, then end with 'Answer: <number>'.")
    s += rl.user(question)
    forks = s.fork(paths)
    for f in forks:
        f += rl.assistant(rl.gen("reasoning", max_tokens=96, temperature=0.8, top_p=0.95))
    forks.join()
    answers = [_final_number(r) for r in forks["reasoning"]]
    votes = Counter(a for a in answers if a is not None)
    s["votes"] = dict(votes)
    s["answer"] = votes.most_common(1)[0][0] if votes else None
    for i, (reasoning, answer) in enumerate(zip(forks["reasoning"], answers)):
        print(f"--- path {i}: answer {answer}\n{reasoning.strip()}")


def _final_number(text: str) -> str | None:
    marked = re.findall(r"Answer:\s*(-?\d+)", text)
    numbers = marked or re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


def run(args: argparse.Namespace) -> None:
    state = self_consistency.run(question=args.question, paths=args.paths)
    print(f"votes: {state['votes']}\nmajority answer: {state['answer']}")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--paths", type=int, default=8)


if __name__ == "__main__":
    main(__doc__.splitlines()[0], run, add_args)
