"""64-bit chained page hashes of a token array, all pages in one numpy pass (uint64 wraparound arithmetic).

``chain_hashes(tokens, page_size, seed)[i]`` depends on ``seed`` and on ``tokens[:(i + 1) * page_size]``
alone, like the content keys of ``radixrelay.radix.page_keys`` (which are blake2b, persistent, and cost a
Python step per page): each page is mixed word by word and summed with per-position weights, then the
pages are chained as a polynomial, ``C[i] = sum_{j <= i} h[j] * M**(i - j) + seed * M**(i + 1)``, computed as
``M**i * cumsum(h[j] * M**-j)`` (``M`` odd, so invertible modulo 2**64), and each ``C[i]`` finalized by a
xorshift-multiply mix. Vectorised over all pages: no Python step per page or token.

These are an index, never proof of equality: 64 bits collide by chance (and the mixing is not meant to
resist chosen collisions). A user either confirms a candidate by comparing the token arrays (the router's
memo of the replicas' content keys) or uses them where a collision only costs a worse guess (the router's
approximate index). The radix tree does not use them: it compares tokens directly, which costs less than
computing these would.
"""

from __future__ import annotations

import hashlib

import numpy as np

from radixrelay.radix.tokens import as_tokens

_MOD = 1 << 64
_M = 0x9E3779B97F4A7C15                     # odd: the chain's multiplier
_M_INV = pow(_M, -1, _MOD)
_K1, _K2, _K3 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93


def seed_of(*parts: str | None) -> int:
    """A 64-bit seed from names (a namespace, a salt; ``None`` differs from ``""``)."""
    h = hashlib.blake2b(digest_size=8, person=b"radixrelay-ph")
    for part in parts:
        h.update(b"\x00" if part is None else b"\x01" + part.encode() + b"\x00")
    return int.from_bytes(h.digest(), "little")


def _weights(n: int, salt: int) -> np.ndarray:
    """``n`` fixed odd uint64 weights (splitmix64 of ``salt + i``)."""
    x = (np.arange(n, dtype=np.uint64) + np.uint64(salt)) * np.uint64(_M)
    x ^= x >> np.uint64(30)
    x *= np.uint64(_K1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(_K2)
    x ^= x >> np.uint64(31)
    return x | np.uint64(1)


def _powers(base: int, n: int) -> np.ndarray:
    """``base ** i`` modulo 2**64 for ``i`` in ``[0, n)`` (uint64)."""
    out = np.empty(n, dtype=np.uint64)
    if n:
        out[0] = 1
        out[1:] = base
        np.cumprod(out, out=out)                # wraps modulo 2**64
    return out


def chain_hashes(tokens, page_size: int, seed: int) -> np.ndarray:
    """uint64 [whole pages of ``tokens``]: the chained hash of each prefix of whole pages."""
    t = as_tokens(tokens)
    pages = len(t) // page_size
    if not pages:
        return np.empty(0, dtype=np.uint64)
    t = np.ascontiguousarray(t[:pages * page_size])
    if page_size % 2 == 0:                      # two ids a word: half the work
        words = t.view(np.uint64).reshape(pages, page_size // 2)
    else:
        words = t.astype(np.uint64).reshape(pages, page_size)
    x = (words + np.uint64(1)) * _weights(words.shape[1], 1)
    x ^= x >> np.uint64(29)
    x *= np.uint64(_K3)
    h = x.sum(axis=1, dtype=np.uint64)           # [pages]: each page's hash, position-weighted
    m_pow = _powers(_M, pages + 1)
    chained = m_pow[:pages] * np.cumsum(h * _powers(_M_INV, pages), dtype=np.uint64)
    chained += np.uint64(seed % _MOD) * m_pow[1:]
    chained ^= chained >> np.uint64(31)
    chained *= np.uint64(_K1)
    chained ^= chained >> np.uint64(29)
    return chained
