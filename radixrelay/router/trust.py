"""Whose KV events a router believes, and which announced replicas may join its pool.

Anyone who can write to the store can append entries, so the router applies only:
- without a key: entries naming a replica it was given (``--replica``) or whose name matches
  ``--replica-pattern`` (a full match); announcements of other names are refused and counted;
- with a key (``--store-key-file``): entries signed with it (``radixrelay.kv_auth``), every kind, given
  replicas' too; a signed announcement of any name may join the pool (that is what the key authorises).

Given replicas are in the pool whatever their events say (health polling decides); announced ones
(matching the pattern, or signed) join while their announcements are fresh (``radixrelay.router.kv_index``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Trust:
    given: frozenset[str] = frozenset()                  # --replica URLs (normalized: check_replica_url)
    pattern: re.Pattern[str] | None = None               # --replica-pattern
    key: bytes | None = field(default=None, repr=False)  # --store-key-file: entries must be signed with it

    def admits(self, name: str) -> bool:
        """Whether entries naming ``name`` are applied (with a key: once their signature is checked)."""
        return self.key is not None or name in self.given or (
            self.pattern is not None and self.pattern.fullmatch(name) is not None)

    def discovers(self) -> bool:
        """Whether replicas beyond the given ones may join the pool by announcing themselves."""
        return self.key is not None or self.pattern is not None


def compile_pattern(text: str | None) -> re.Pattern[str] | None:
    """``--replica-pattern``, compiled; ``ValueError`` saying why it is no regular expression."""
    if text is None:
        return None
    if not text:
        raise ValueError("--replica-pattern: give a regular expression, e.g. 'http://10\\.0\\.0\\.[0-9]+:30000'")
    try:
        return re.compile(text)
    except re.error as exc:
        raise ValueError(f"--replica-pattern {text!r}: not a regular expression ({exc})") from None


def make_trust(replicas: tuple[str, ...], pattern: str | None, key_file: str | None) -> Trust:
    """The router's trust from its flags (the key read from ``key_file``); ``ValueError`` saying what is
    wrong with them."""
    from radixrelay.kv_auth import read_key

    key = read_key(key_file, "--store-key-file") if key_file is not None else None
    return Trust(frozenset(replicas), compile_pattern(pattern), key)
