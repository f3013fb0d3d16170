"""Prompt-lookup drafts (``radixrelay.scheduler.ngram_drafts``): the tokens after the latest earlier
occurrence of the longest suffix found, indexed incrementally and checked against the tokens."""

from __future__ import annotations

import numpy as np
import pytest

from radixrelay.scheduler import ngram_drafts
from radixrelay.scheduler.ngram_drafts import NgramIndex


def brute(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):          # latest earlier occurrence with a next token
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def test_a_quoting_answer_drafts_the_quoted_text():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5, 6, 7, 1, 2]
    index = NgramIndex(2, 4)
    index.extend(prompt)
    assert index.propose(4) == []                    # (1, 2) never occurred before
    index.extend([8, 9])                             # the answer starts quoting "8 9 10 11 12"
    assert index.propose(3) == [10, 11, 12]
    index.extend([10, 11, 12, 3])
    assert index.propose(2) == [4, 5]                # "12 3" occurred once


def test_the_longest_suffix_wins_and_the_latest_occurrence():
    index = NgramIndex(1, 3)
    index.extend([1, 2, 9, 4, 2, 8, 1, 2, 7, 5, 1, 2])
    # "1 2" occurred at 0 and 6 (then 9 and 7): the latest, 6, is followed by 7; "x 1 2" of length 3: "5 1 2" never
    assert index.propose(2) == [7, 5]


@pytest.mark.parametrize("seed", range(5))
def test_incremental_indexing_equals_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 6, 400).tolist()
    index = NgramIndex(2, 4)
    at = 0
    while at < len(tokens):
        step = int(rng.integers(1, 40))
        index.extend(tokens[at:at + step])
        at += step
        assert index.propose(5) == brute(tokens[:at], 5, 2, 4), at
    whole = NgramIndex(2, 4)
    whole.extend(tokens)
    assert whole.propose(5) == index.propose(5)


def test_a_hash_collision_never_drafts_wrong_tokens(monkeypatch):
    monkeypatch.setattr(ngram_drafts, "_hashes", lambda t, n: np.zeros(len(t) - n + 1, dtype=np.uint64))
    index = NgramIndex(2, 2)
    index.extend([1, 2, 3, 4, 5, 6])                 # every bigram collides: the map keeps (4, 5)'s end
    assert index.propose(3) == []                    # found, checked: "4 5" is not "5 6", so no draft


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(3, 2)
