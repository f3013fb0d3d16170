"""Content keys of KV pages for the lower cache tiers (host memory, disk).

Page ``i`` of a token sequence is keyed by a chained digest:
``key[-1] = H(namespace, salt)``, ``key[i] = H(key[i - 1], tokens[i * page_size : (i + 1) * page_size])``
(blake2b, 16 bytes). A key therefore names the KV of a whole prefix: equal keys mean equal tokens from
position 0 under the same salt and the same model and KV layout (``namespace``), so the lower tiers can
be content-addressed without a tree of their own, never serve KV across salts, and a disk directory
reused by a restart with another model or page size never matches (different namespace, different keys).

The bytes hashed for a page are its tokens as native int64 (8 bytes a token), made from the int32 token
array in one numpy conversion; keys are on disk and in KV events, so this format does not change. What
is kept cheap is how often a page is hashed: a radix node's keys are computed once in its life and kept
on it (``path_keys``), and a request hashes only pages past what its tree path holds, as far as a tier
asks (``radixrelay.scheduler.content_keys``).
"""

from __future__ import annotations

import hashlib

import numpy as np

from radixrelay.radix.tokens import TokenArray, as_tokens

KEY_BYTES = 16


def chain_seed(namespace: str, salt: str | None) -> bytes:
    """The key before page 0: distinct per (namespace, salt); ``None`` and ``""`` salts differ."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"radixrelay-ns")
    h.update(namespace.encode())
    h.update(b"\x00" if salt is None else b"\x01" + salt.encode())
    return h.digest()


def path_keys(path, seed: bytes, page_size: int) -> list[bytes]:
    """Content keys of the pages of a radix-tree path (``RadixNode``s from the root's child down; ``seed``:
    ``chain_seed`` of its namespace and salt), each node's kept on it (``RadixNode.page_keys``) and
    computed only where a node has none yet, so a shared prefix is hashed once."""
    keys: list[bytes] = []
    prev = seed
    for node in path:
        if node.page_keys is None:
            node.page_keys = extend_keys([], prev, node.key, page_size, len(node.pages))
        keys.extend(node.page_keys)
        prev = keys[-1] if keys else seed
    return keys


def extend_keys(keys: list[bytes], seed: bytes, token_ids: TokenArray | np.ndarray | list[int], page_size: int,
                num_pages: int) -> list[bytes]:
    """Append the keys of pages ``len(keys) .. num_pages - 1`` of ``token_ids`` to ``keys`` (in place;
    earlier keys are kept: token lists only grow) and return it. ``num_pages`` whole pages must exist."""
    if num_pages * page_size > len(token_ids):
        raise ValueError(f"extend_keys: {num_pages} pages of {page_size} need {num_pages * page_size} "
                         f"tokens, got {len(token_ids)}")
    prev = keys[-1] if keys else seed
    first = len(keys)
    if first >= num_pages:
        return keys
    # the new pages' tokens as native int64 bytes in one conversion; each page hashes a slice of them
    lo, hi = first * page_size, num_pages * page_size
    tokens = as_tokens(token_ids, hi)[lo:hi] if isinstance(token_ids, (TokenArray, np.ndarray)) else \
        as_tokens(token_ids[lo:hi])
    data = memoryview(tokens.astype(np.int64).tobytes())
    step = page_size * 8
    blake2b = hashlib.blake2b
    for j in range(num_pages - first):
        h = blake2b(prev, digest_size=KEY_BYTES)
        h.update(data[j * step:(j + 1) * step])
        prev = h.digest()
        keys.append(prev)
    return keys
