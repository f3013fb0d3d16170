"""Token-id prompts parsed from JSON text and reused by prefix (``radixrelay.text.json_ids``): every
result equals a fresh parse of the whole text, whatever was parsed before."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from radixrelay.text.json_ids import IdPrefixCache


def _inner(ids, sep: str = ",") -> bytes:
    return json.dumps([int(i) for i in ids], separators=(sep, ":")).encode()[1:-1]


def _doc(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 200_000, n)


def test_questions_over_one_document_reuse_its_ids_and_equal_a_fresh_parse() -> None:
    cache = IdPrefixCache(min_bytes=0)
    doc = _doc(20_000)
    first = cache.parse(_inner(doc))
    assert np.array_equal(first, doc) and cache.parsed_ids == len(doc)
    for q in range(5):
        question = np.random.default_rng(100 + q).integers(0, 200_000, 7)
        ids = cache.parse(_inner(np.concatenate([doc, question])))
        assert np.array_equal(ids, np.concatenate([doc, question]))
    # the document's ids were parsed once; each question parsed its own ids (and at most the seam's)
    assert cache.reused_ids >= 5 * (len(doc) - 1)
    assert cache.parsed_ids <= len(doc) + 5 * 8


@pytest.mark.parametrize("old, new", [
    ([1, 2, 345], [1, 2, 3456]),          # the texts differ inside the last id
    ([1, 2, 3456], [1, 2, 345]),          # the new id is a prefix of the old one
    ([12, 34], [12, 34, 56]),             # the old text is a prefix of the new one
    ([12, 34, 56], [12, 34]),             # the new text is a prefix of the old one
    ([12, 34, 56], [12, 34, 56]),         # the same text
    ([12, 34, 56], [12, 3, 56]),
    ([5, 6, 7], [9, 6, 7]),               # nothing shared
    ([123], [12]),
    ([7, 8], [7, 8, 9, 10, 11]),
])
def test_every_kind_of_seam_gives_the_fresh_parse(old, new) -> None:
    cache = IdPrefixCache(min_bytes=0)
    assert np.array_equal(cache.parse(_inner(old)), old)
    assert np.array_equal(cache.parse(_inner(new)), new)
    assert np.array_equal(cache.parse(_inner(old)), old)


def test_spaced_arrays_and_refusals() -> None:
    cache = IdPrefixCache(min_bytes=0)
    doc = _doc(500, 1)
    assert np.array_equal(cache.parse(_inner(doc, ", ")), doc)
    assert np.array_equal(cache.parse(_inner(np.concatenate([doc, [5]]), ", ")), np.concatenate([doc, [5]]))
    # a signed, fractional or oversized id after a shared prefix is refused as in a fresh parse
    for tail in (b",-1", b",1.5", b",99999999999999999999", b',"x"'):
        assert cache.parse(_inner(doc, ", ") + tail) is None
    assert cache.parse(b"") is None


def test_results_are_read_only() -> None:
    cache = IdPrefixCache(min_bytes=0)
    ids = cache.parse(_inner(_doc(100)))
    with pytest.raises(ValueError):
        ids[0] = 1
    again = cache.parse(_inner(_doc(100)))
    assert np.array_equal(again, _doc(100))


def test_entries_are_bounded_and_least_recently_used_go_first() -> None:
    cache = IdPrefixCache(max_entries=3, min_bytes=0)
    docs = [_doc(3000, seed) for seed in range(5)]
    for d in docs:
        cache.parse(_inner(d))
    assert len(cache) == 3
    before = cache.reused_ids
    cache.parse(_inner(docs[0]))                                   # evicted: parsed again
    assert cache.reused_ids == before
    cache.parse(_inner(docs[4]))                                   # kept: reused
    assert cache.reused_ids == before + len(docs[4])
    small = IdPrefixCache(min_bytes=1 << 20)
    small.parse(_inner(docs[0]))
    assert len(small) == 0                                         # short texts are not kept


def test_concurrent_parses_of_overlapping_prompts_are_all_exact() -> None:
    cache = IdPrefixCache(max_entries=4, min_bytes=0)
    doc = _doc(30_000, 7)
    failures: list[int] = []

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        for _ in range(20):
            cut = int(rng.integers(1, len(doc)))
            ids = np.concatenate([doc[:cut], rng.integers(0, 200_000, int(rng.integers(1, 50)))])
            if not np.array_equal(cache.parse(_inner(ids)), ids):
                failures.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_a_flat_id_prompt_is_cut_out_of_its_body_and_anything_else_is_left_to_the_decoder() -> None:
    from radixrelay.text.json_ids import PLACEHOLDER, split_prompt

    rest, ids = split_prompt(b'{"model": "m", "prompt" : [ 7 , 80 ], "n": 2}')
    assert json.loads(rest) == {"model": "m", "prompt": int(PLACEHOLDER), "n": 2} and ids.tolist() == [7, 80]
    for body in (b'{"prompt": "text"}', b'{"prompt": [[1], [2]]}', b'{"prompt": [1, -2]}',
                 b'{"prompt": [1, 2.5]}', b'{"prompt": [01, 2]}', b'{"prompt": [1 2]}', b'{"prompt": [1,,2]}',
                 b'{"prompt": []}', b'{"prompt": [1], "x": {"prompt": [2]}}', b'{"model": "m"}',
                 b'{"prompt": [1, 2'):
        assert split_prompt(body) is None, body
