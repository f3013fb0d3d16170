"""A batch of documents, each asked 4 questions: ``run_batch`` over documents, ``fork(4)`` per
document. Each document is computed once and shared by its 4 questions.
"""

from __future__ import annotations

import argparse
import random

import radixrelay.lang as rl
from common import main

QUESTIONS = ["Who is the main person?", "Where does it happen?", "What went wrong?",
             "Summarise it in five words."]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana"]
PLACES = ["a harbour town", "a mountain village", "a busy airport", "a small bakery", "a library"]
PROBLEMS = ["the power went out", "a storm closed the roads", "the keys were lost",
            "the delivery never came", "the oven broke"]


def make_document(i: int) -> str:
    rng = random.Random(i)
    name, place, problem = rng.choice(NAMES), rng.choice(PLACES), rng.choice(PROBLEMS)
    return (f"Report {i}. {name} spent the whole week in {place}. On the third day {problem}, "
            f"so {name} asked the neighbours for help and fixed things by the evening.")


@rl.function
def ask(s, document: str):
    s += rl.system("Answer briefly, using only the document.")
    s += rl.user(f"Document:\n{document}")
    s += rl.assistant("I have read the document.")
    forks = s.fork(len(QUESTIONS))
    for f, question in zip(forks, QUESTIONS):
        f += rl.user(question)
        f += rl.assistant(rl.gen("answer", max_tokens=16, temperature=0))
    s["answers"] = dict(zip(QUESTIONS, forks["answer"]))


def run(args: argparse.Namespace) -> None:
    documents = [make_document(i) for i in range(args.documents)]
    states = ask.run_batch([{"document": d} for d in documents], num_threads=args.threads,
                           progress_bar=True)
    failed = [s.error for s in states if s.error is not None]
    print(f"{len(states) - len(failed)} documents answered, {len(failed)} failed")
    if failed:
        raise failed[0]
    for document, state in list(zip(documents, states))[:3]:
        print(f"\n{document}")
        for question, answer in state["answers"].items():
            print(f"  {question} -> {answer.strip()}")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--threads", type=int, default=16)


if __name__ == "__main__":
    main(__doc__.splitlines()[0], run, add_args)
