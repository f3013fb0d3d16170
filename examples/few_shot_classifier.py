"""A few-shot sentiment classifier with select: the label with the highest mean log-probability.

The few-shot examples are the same for every input, so the server computes them once. ``select``
needs prompt logprobs (completions with ``echo`` + ``logprobs``) from the backend.
"""

from __future__ import annotations

import argparse

import radixrelay.lang as rl
from common import main

EXAMPLES = [
    ("The pasta was delicious and the staff were friendly.", "positive"),
    ("We waited an hour and the soup was cold.", "negative"),
    ("Great view, fair prices, would come back.", "positive"),
    ("The room smelled and the bed was broken.", "negative"),
]
INPUTS = [
    "Lovely little place, the dessert was perfect.",
    "Rude waiter and a dirty table.",
    "Nothing special, but the coffee was fine and cheap.",
]


@rl.function
def classify(s, review: str):
    s += "Classify each review as positive or negative.\n\n"
    for text, label in EXAMPLES:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment:"
    s += rl.select("label", choices=[" positive", " negative"])


def run(args: argparse.Namespace) -> None:
    states = classify.run_batch([{"review": r} for r in INPUTS])
    for review, state in zip(INPUTS, states):
        if state.error is not None:
            raise state.error
        scores = ", ".join(f"{s:.3f}" for s in state.meta("label").scores)
        print(f"{state['label'].strip():8} [{scores}]  {review}")


if __name__ == "__main__":
    main(__doc__.splitlines()[0], run)
