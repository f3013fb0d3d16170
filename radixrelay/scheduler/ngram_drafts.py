"""Drafts without a draft model: prompt lookup over one request's own tokens (prompt and outputs).

The request's latest ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) are looked up among its earlier
tokens; where they occurred before, the tokens that followed their latest earlier occurrence are the draft
(answers that quote their prompt, code edited in place, agents re-emitting arguments).

``NgramIndex`` keeps, per ``n``, a map from an n-gram's hash to the position after its latest occurrence
whose next token is known; it grows with the tokens (``extend``, vectorised: a 112K-token prompt is indexed
in numpy passes, not a Python loop per token), and a proposal costs one lookup per ``n``. Hashes are 64-bit
polynomial hashes; a hit is checked against the tokens, so a collision costs a missed draft, never a
wrong one (and a wrong draft would only be rejected by verification).

Cost on this project's 2-core CPU: indexing 112K tokens (n = 2..4) ~0.1 s, which is the dict inserts; then
~0.07 ms per appended token and ~0.02 ms per proposal: a long prompt is best indexed when its request first
speculates, not on the path of its admission. (Not wired into the scheduler yet: speculative decoding's
step model comes first.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_BASE = np.uint64(0x100000001B3)          # FNV-64 prime as the polynomial base (arithmetic mod 2^64)


def _hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """uint64 hash of every n-gram ``tokens[i:i + n]``, i in [0, len - n]."""
    t = tokens.astype(np.uint64)
    h = np.zeros(len(tokens) - n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            h = h * _BASE + t[i:len(tokens) - n + 1 + i] + np.uint64(1)
    return h


class NgramIndex:
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._buf = np.zeros(16, dtype=np.int32)     # the tokens in [0, _len); capacity doubles as they grow
        self._len = 0
        self._maps: dict[int, dict[int, int]] = {n: {} for n in range(min_n, max_n + 1)}

    def __len__(self) -> int:
        return self._len

    @property
    def _tokens(self) -> np.ndarray:
        return self._buf[:self._len]

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append ``tokens``; index the n-grams whose next token is now known."""
        new = np.asarray(tokens, dtype=np.int32)
        if not len(new):
            return
        old, total = self._len, self._len + len(new)
        if total > len(self._buf):
            grown = np.zeros(max(total, 2 * len(self._buf)), dtype=np.int32)
            grown[:old] = self._buf[:old]
            self._buf = grown
        self._buf[old:total] = new
        self._len = total
        for n, found in self._maps.items():
            # n-grams ending at e in (old - 1, total - 1]: starts from max(0, old - n) to total - 1 - n
            first = max(0, old - n)
            if total - 1 - first < n:
                continue
            window = self._buf[first:total - 1]
            hashes = _hashes(window, n)
            ends = np.arange(first + n, first + n + len(hashes))
            found.update(zip(hashes.tolist(), ends.tolist()))   # later occurrences overwrite earlier ones

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix found (of
        ``max_n`` down to ``min_n`` tokens); [] when none occurred before."""
        tokens, total = self._tokens, self._len
        if k <= 0:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n:]
            end = self._maps[n].get(int(_hashes(suffix, n)[0]))
            if end is not None and end < total and np.array_equal(tokens[end - n:end], suffix):
                return tokens[end:end + k].tolist()
        return []
