"""Test helper: raw KV-event stream entries, as a replica (or anyone who can write to the store) appends them,
and an index that has read them all."""

from __future__ import annotations

import time

from radixrelay.kv_auth import SIG, sign
from radixrelay.kv_schema import VERSION
from radixrelay.kv_store import STREAM

NS = "model-a/layout-1"
PS = 4


def entry(kind: str, replica: str, instance: str = "i1", seq: int | None = 1, t: float | None = None,
          key: bytes | None = None, v: bytes | None = str(VERSION).encode(), **fields: bytes) -> dict[bytes, bytes]:
    """An entry's fields (``fields``' names with ``_`` for ``-``); signed with ``key`` when given."""
    out = {b"kind": kind.encode(), b"replica": replica.encode(), b"instance": instance.encode(),
           b"t": repr(time.time() if t is None else t).encode()}
    if v is not None:
        out[b"v"] = v
    if seq is not None:
        out[b"seq"] = str(seq).encode()
    out.update({k.encode(): v for k, v in fields.items()})
    if key is not None:
        out[SIG] = sign(key, out)
    return out


def hello(replica: str, instance: str = "i1", seq: int = 1, **kw) -> dict[bytes, bytes]:
    kw.setdefault("namespace", NS.encode())
    kw.setdefault("page_size", str(PS).encode())
    return entry("hello", replica, instance, seq, **kw)


def append(client, *entries: dict[bytes, bytes]) -> None:
    for fields in entries:
        client.xadd(STREAM, fields)


def read_all(index, timeout: float = 10.0) -> None:
    """``index`` has applied every entry the stream holds now."""
    last = index.client.xrevrange(STREAM, count=1)
    if not last:
        return
    deadline = time.monotonic() + timeout
    while index.last_id != last[0][0]:
        assert time.monotonic() < deadline, "the index did not read the stream"
        if index._thread is None:            # no reader thread: read here
            index.catch_up(50)
        else:
            time.sleep(0.02)
