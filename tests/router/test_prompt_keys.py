"""The router's prompt keys (``router/prompt.py``) and its look-up of replicas' content keys
(``router/kv_index.py``): token-id prompts checked in C-speed passes, 64-bit page hashes for the
approximate index (prefix-determined, salts apart), and replicas' keys remembered across prompts
(``KeyMemo``) without ever trusting a hash: a forced collision still matches only equal tokens."""

from __future__ import annotations

import numpy as np
import pytest

from radixrelay.radix.page_keys import chain_seed, extend_keys
from radixrelay.router import kv_index
from radixrelay.router.kv_index import KVEventIndex, ReplicaHoldings
from radixrelay.router.prompt import PAGE_TOKENS, InvalidPrompt, Prompt, PromptKeys, token_id_array

NS, PS = "model/layout", 16


def test_token_id_lists_are_checked_in_c_speed_passes():
    assert token_id_array([5, 0, 7]).tolist() == [5, 0, 7] and token_id_array([5]).dtype == np.int32
    assert token_id_array([1, True]) is None and token_id_array([1, 2.0]) is None     # not ids: route by load
    assert token_id_array(["a", 1]) is None and token_id_array([[1], [2]]) is None
    for bad in ([1, -1], [1, 1 << 31], [1, 2**64, 3]):
        with pytest.raises(InvalidPrompt, match="token ids"):
            token_id_array(bad)


def test_approximate_keys_name_whole_prefixes_under_each_salt():
    keys = PromptKeys(tokenizer=None, template=None)
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 50000, 40 * PAGE_TOKENS, dtype=np.int32)
    other = doc.copy()
    other[25 * PAGE_TOKENS + 3] += 1                       # differs inside page 25
    a, b = keys.keys_of(Prompt(doc, None)), keys.keys_of(Prompt(other, None))
    assert len(a) == 40 and all(len(k) == 8 for k in a)
    assert a[:25] == b[:25] and not set(a[25:]) & set(b[25:])
    assert keys.keys_of(Prompt(doc[:10 * PAGE_TOKENS + 5], None)) == a[:10]
    assert not set(keys.keys_of(Prompt(doc, "tenant"))) & set(a)          # salts never share a key
    assert not set(keys.keys_of(Prompt(doc, ""))) & set(a)                # "" is not None


def test_bodies_parsed_by_the_proxy_give_the_keys_of_their_json():
    """``parse_object`` reads a flat token-id prompt into an array (shared with recent prompts by
    prefix); its keys, and every other field, are those of the body as ``json.loads`` reads it."""
    import json

    from radixrelay.router.proxy import parse_object

    keys = PromptKeys(tokenizer=None, template=None)
    doc = np.random.default_rng(1).integers(0, 50000, 20 * PAGE_TOKENS).tolist()
    for tail in ([7], [8, 9], []):
        raw = json.dumps({"model": "m", "prompt": doc + tail, "stream": True, "cache_salt": "t",
                          "stop": ["x"], "seed": 3}).encode()
        fast, slow = parse_object(raw), json.loads(raw)
        assert isinstance(fast["prompt"], np.ndarray)
        assert {k: v for k, v in fast.items() if k != "prompt"} == {k: v for k, v in slow.items() if k != "prompt"}
        assert keys.keys("completions", fast) == keys.keys("completions", slow)
    for bad in ([1, 1 << 31], [1, 2**64, 3], [1, -1]):
        body = parse_object(json.dumps({"prompt": bad}).encode())
        with pytest.raises(InvalidPrompt, match="token ids"):
            keys.keys("completions", body)


class _NoStore:
    def close(self) -> None:
        pass


def _index(held: dict[str, tuple[str, int, set[bytes]]], monkeypatch) -> KVEventIndex:
    """An index whose replicas hold ``held`` (as their events would have told), no store read."""
    monkeypatch.setattr(kv_index, "connect", lambda url, password=None: _NoStore())
    index = KVEventIndex("redis://127.0.0.1:1")
    for name, (namespace, ps, keys) in held.items():
        index.replicas[name] = ReplicaHoldings(namespace=namespace, page_size=ps, keys=set(keys))
    return index


def _keys(tokens, salt=None, namespace=NS, ps=PS) -> list[bytes]:
    return extend_keys([], chain_seed(namespace, salt), list(map(int, tokens)), ps, len(tokens) // ps)


def test_replicas_keys_are_remembered_across_prompts_and_hashed_once(monkeypatch):
    rng = np.random.default_rng(1)
    doc = rng.integers(0, 50000, 200 * PS, dtype=np.int32)                  # 200 pages
    index = _index({"a": (NS, PS, set(_keys(doc))), "b": (NS, PS, set(_keys(doc)[:120])),
                    "c": ("other/layout", 8, set(_keys(doc, namespace="other/layout", ps=8)[:50]))}, monkeypatch)
    hashed = []
    real = extend_keys
    monkeypatch.setattr(kv_index, "extend_keys", lambda keys, *a: hashed.append(a[-1] - len(keys)) or real(keys, *a))
    for q in range(4):
        prompt = np.concatenate([doc, rng.integers(0, 50000, 3 * PS + 5, dtype=np.int32)])
        hashed.clear()
        assert index.matched_tokens_many(["a", "b", "c", "zz"], prompt, None) == [200 * PS, 120 * PS, 50 * 8, 0]
        if q == 0:
            assert sum(hashed) <= 200 + 50 + 4 + 50 // 4 + 8 + 2 * 16      # each layout's matched pages (+ runs)
        else:                                                            # remembered: a few new pages only
            assert sum(hashed) <= 2 * kv_index.MEMO_EVERY + 16, (q, hashed)
    assert index.memo.hits >= 3 * 2
    assert index.matched_tokens("a", doc, "tenant") == 0                 # another salt: nothing remembered
    index.client.close()


def test_a_forced_hash_collision_still_matches_only_equal_tokens(monkeypatch):
    """Every page hash made one constant: every remembered prompt is a candidate for every other, and
    the token compare keeps each match exact (as computed without any memo)."""
    monkeypatch.setattr(kv_index, "chain_hashes", lambda tokens, ps, seed: np.zeros(len(tokens) // ps, np.uint64))
    rng = np.random.default_rng(2)
    doc = rng.integers(0, 50000, 100 * PS, dtype=np.int32)
    fork = doc.copy()
    fork[70 * PS + 1] += 1                                  # equal for 70 pages, then different
    other = rng.integers(0, 50000, 100 * PS, dtype=np.int32)
    held = set(_keys(doc)) | set(_keys(fork)) | set(_keys(other)[:40])
    index = _index({"r": (NS, PS, held)}, monkeypatch)
    for prompt, want in ((doc, 100), (other, 40), (fork, 100), (doc[:90 * PS], 90), (other, 40),
                         (np.concatenate([doc[:80 * PS], other[80 * PS:]]), 80)):
        assert index.matched_tokens("r", prompt, None) == want * PS
    assert index.memo.collisions > 0
    index.client.close()


def test_the_memo_is_bounded_and_forgets_the_least_recently_used_prompt():
    memo = kv_index.KeyMemo(max_pages=100, every=8)
    layout = (NS, 4, None)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 50000, 40 * 4, dtype=np.int32) for _ in range(4)]
    for p in prompts:
        memo.remember(layout, p, _keys(p, ps=4))
    assert memo._pages <= 100 and len(memo._entries) == 2             # 40 pages each: the first two forgotten
    assert memo.keys(layout, prompts[0])[0] == [] and memo.keys(layout, prompts[3])[0] == _keys(prompts[3], ps=4)
    assert {i for i in memo._index.values()} == set(memo._entries)    # no entry of a forgotten prompt is left
    assert memo.keys((NS, 4, "s"), prompts[3])[0] == []               # another salt: another layout
