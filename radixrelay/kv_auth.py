"""Signed KV events: an HMAC-SHA256 over every field of a stream entry (``radixrelay.kv_events``), under a
key the replicas (``serve --kv-events-key-file``) and the routers (``router --store-key-file``) share.

The signature (field ``sig``, 64 hex digits) covers every other field of the entry, known or not: its
kind, replica name, instance, time, sequence number and payload, so an entry can be neither forged nor
altered. Replays of a whole signed entry are the router's to refuse (per-instance sequence numbers,
instances ordered by their signed time: ``radixrelay.router.kv_index``).

Signed bytes: a domain tag, then each field but ``sig`` in byte order of its name, as 4-byte big-endian
length + name + 4-byte length + value (unambiguous: no two entries sign the same bytes).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from radixrelay.kv_store import read_secret

SIG = b"sig"
DOMAIN = b"radixrelay-kv-events\x00"
MIN_KEY_BYTES = 16


def read_key(path: str, what: str) -> bytes:
    """The shared key: the first line of ``path`` (at least ``MIN_KEY_BYTES`` bytes; e.g. the output of
    ``openssl rand -hex 32``); ``ValueError`` saying why not."""
    key = read_secret(path, what)
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{what}: the key in {path} is {len(key)} bytes; give at least {MIN_KEY_BYTES} "
                         "(e.g. openssl rand -hex 32 > FILE)")
    return key


def _signed_bytes(fields: Mapping[bytes, bytes]) -> bytes:
    parts = [DOMAIN]
    for name in sorted(fields):
        if name == SIG:
            continue
        value = fields[name]
        parts += (len(name).to_bytes(4, "big"), name, len(value).to_bytes(4, "big"), value)
    return b"".join(parts)


def sign(key: bytes, fields: Mapping[bytes, bytes]) -> bytes:
    """The ``sig`` value of an entry of ``fields`` (any ``sig`` among them is left out)."""
    return hmac.new(key, _signed_bytes(fields), hashlib.sha256).hexdigest().encode()


def verify(key: bytes, fields: Mapping[bytes, bytes]) -> bool:
    """Whether ``fields`` carry a ``sig`` made with ``key`` over the others (constant-time comparison)."""
    sig = fields.get(SIG)
    return isinstance(sig, bytes) and hmac.compare_digest(sign(key, fields), sig)
