"""By-hand select scores: the default model's prompt log-probabilities from one forward pass.

The model is transformers' GGUF loader on the same file the server serves (float32, CPU); the
tokens are radixrelay's tokenizer's (what the server tokenizes). A choice's tokens are
``ids(prefix + choice)`` after its longest common leading run with ``ids(prefix)`` (the rule
``radixrelay.lang.scoring`` documents), its score the mean of their logprobs.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from radixrelay.model.model_registry import resolve_model_path
from radixrelay.text.tokenizer import Tokenizer, load_tokenizer


@functools.lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model_path("default"))


# transformers' logprob of " Paris" after "The capital of France is" (float32, CPU, this module's model):
# test_select.py checks that the reference computes it, test_programs.py that the server's logprob agrees
# with it, so the server and the reference agree without both running in one test.
PARIS_PROMPT, PARIS, PARIS_LOGPROB = "The capital of France is", " Paris", -0.258062

_load_lock = threading.Lock()      # the stub server may ask from several threads at once


def model() -> Any:
    with _load_lock:
        return _load_model()


@functools.lru_cache(maxsize=1)
def _load_model() -> Any:
    from tests.engine.hf_reference import _hf_model

    return _hf_model()


@functools.lru_cache(maxsize=64)
def _token_logprobs(ids: tuple[int, ...]) -> tuple[float | None, ...]:
    with torch.inference_mode():
        logits = model()(torch.tensor([ids])).logits[0].float()          # [tokens, vocab]
    logprobs = torch.log_softmax(logits, dim=-1)
    return (None, *(logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))))


def token_logprobs(ids: list[int]) -> list[float | None]:
    """logprob of each token given the ones before it (None for the first); one forward pass per
    distinct sequence (the stand-in server and the by-hand scores ask for the same ones)."""
    return list(_token_logprobs(tuple(ids)))


def choice_scores(prefix: str, choices: list[str], logprobs_of=None) -> list[float]:
    """Mean logprob of each choice's tokens after ``prefix``; ``logprobs_of(ids)`` gives the
    per-token logprobs (default: transformers' forward pass, ``token_logprobs``)."""
    logprobs_of = logprobs_of or token_logprobs
    prefix_ids = tokenizer().encode(prefix)
    scores = []
    for choice in choices:
        ids = tokenizer().encode(prefix + choice)
        common = 0
        while common < min(len(ids), len(prefix_ids)) and ids[common] == prefix_ids[common]:
            common += 1
        values = logprobs_of(ids)[common:]
        scores.append(sum(values) / len(values))
    return scores
