"""KV events through Redis: what each replica's radix tree holds, for routers that route precisely
(the publisher runs in a replica's scheduler, ``scheduler.kv_events``; the index in a router,
``router.kv_index``).

A replica (``radixrelay serve --kv-events redis://HOST:PORT/DB``) appends to one Redis Stream
(``STREAM``), from a background thread (a step never waits for Redis; a full queue drops events and
counts them). Entries follow ``radixrelay.kv_schema`` (version ``v``, a per-instance ``seq``, and with
``--kv-events-key-file`` a signature ``sig``, ``radixrelay.kv_auth``):

- ``hello``: its name (the URL routers know it by), a fresh instance id, the page-key namespace
  (model and KV layout) and page size. Again every ``HELLO_EVERY_S``.
- ``stored`` / ``removed``: page keys (``radixrelay.radix.page_keys``: each names a whole prefix, salt
  included) that entered its radix tree, or left it (evicted from the device); at most
  ``kv_schema.MAX_ENTRY_KEYS`` per entry (longer lists are split).
- ``cleared``: its tree was emptied (``/flush_cache``); also the start of a snapshot of the device's
  pages (``stored`` of every key the tree holds follows), every ``scheduler.kv_event_hook.SNAPSHOT_EVERY_S``.
- ``tier_stored`` / ``tier_removed`` (with ``tier``: ``host`` or ``disk``): page keys that entered or left
  the replica's host-memory or disk tier (a page copied to host memory after its step, written to disk,
  read back from disk; evicted from either); ``tier_cleared``, then the tier's keys again: a snapshot,
  every ``scheduler.kv_event_hook.SNAPSHOT_EVERY_S`` and whenever changes came faster than it could
  follow. A replica started on a disk tier that kept pages announces them this way.
- ``load``: requests running and waiting, KV use, and the replica's measured rates (prefill, host-memory
  loads, disk reads; tokens per second), every second (``scheduler.kv_event_hook.LOAD_EVERY_S``).

Each router (``radixrelay router --mode precise --store redis://...``) reads the stream from its start
(so a restarted router rebuilds what it knew) and then as it grows, keeping per replica the keys it
holds (``radixrelay.router.kv_index``: what it believes and why). The stream is trimmed to about
``MAX_EVENTS`` entries.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid

from radixrelay.kv_auth import SIG, sign
from radixrelay.kv_schema import MAX_ENTRY_KEYS, VERSION
from radixrelay.kv_store import MAX_EVENTS, STREAM, check_store_url, connect  # noqa: F401 - re-exported

logger = logging.getLogger("radixrelay.events")

HELLO_EVERY_S = 30.0
QUEUE_EVENTS = 65536            # events a replica buffers before it drops (and counts) new ones
BATCH = 512                     # events per Redis round trip


class KVEventPublisher:
    """A replica's side: ``stored``/``removed``/``cleared``/``load`` enqueue (never block); a thread numbers
    (``seq``), signs (with ``key``) and sends them, in order."""

    def __init__(self, url: str, replica: str, namespace: str, page_size: int, queue_events: int = QUEUE_EVENTS,
                 *, key: bytes | None = None, password: str | None = None) -> None:
        self.client = connect(url, password=password)
        self.replica, self.namespace, self.page_size = replica, namespace, page_size
        self.instance = uuid.uuid4().hex
        self.sent = 0
        self.dropped = 0
        self.failed = 0                         # events lost to a store that stopped answering
        self._key = key
        self._seq = 0                           # the sending thread's alone: numbers follow stream order
        self._failing = False
        self._queue: queue.Queue[dict[bytes, bytes] | None] = queue.Queue(queue_events)
        self._hello_at = 0.0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _fields(self, kind: bytes, **fields: bytes) -> dict[bytes, bytes]:
        return {b"v": str(VERSION).encode(), b"kind": kind, b"replica": self.replica.encode(),
                b"instance": self.instance.encode(), b"t": repr(time.time()).encode(),
                **{k.encode(): v for k, v in fields.items()}}

    def _event(self, kind: bytes, **fields: bytes) -> None:
        try:
            self._queue.put_nowait(self._fields(kind, **fields))
        except queue.Full:
            self.dropped += 1

    def _keys(self, kind: bytes, keys: list[bytes], **fields: bytes) -> None:
        for i in range(0, len(keys), MAX_ENTRY_KEYS):
            self._event(kind, keys=b"".join(keys[i:i + MAX_ENTRY_KEYS]), **fields)

    def stored(self, keys: list[bytes]) -> None:
        self._keys(b"stored", keys)

    def removed(self, keys: list[bytes]) -> None:
        self._keys(b"removed", keys)

    def cleared(self) -> None:
        self._event(b"cleared")

    def tier_stored(self, tier: str, keys: list[bytes]) -> None:
        self._keys(b"tier_stored", keys, tier=tier.encode())

    def tier_removed(self, tier: str, keys: list[bytes]) -> None:
        self._keys(b"tier_removed", keys, tier=tier.encode())

    def tier_cleared(self, tier: str) -> None:
        self._event(b"tier_cleared", tier=tier.encode())

    def load(self, running: int, waiting: int, kv_usage: float, rates: dict[str, float] | None = None) -> None:
        """``rates``: of ``kv_schema.RATES``, those measured (tokens per second, > 0)."""
        body = {"running": running, "waiting": waiting, "kv_usage": round(min(max(kv_usage, 0.0), 1.0), 4)}
        body.update({name: float(f"{rate:.6g}") for name, rate in (rates or {}).items() if rate > 0})
        self._event(b"load", load=json.dumps(body).encode())

    def _hello(self) -> dict[bytes, bytes]:
        self._hello_at = time.monotonic()
        return self._fields(b"hello", namespace=self.namespace.encode(), page_size=str(self.page_size).encode())

    def _run(self) -> None:
        import redis

        pending: list[dict[bytes, bytes]] = [self._hello()]
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                item = {}
            if item is None:                     # closing: what is pending goes out first
                self._send(pending, redis)
                return
            if item:
                pending.append(item)
            while len(pending) < BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._send(pending, redis)
                    return
                pending.append(more)
            if time.monotonic() - self._hello_at > HELLO_EVERY_S:
                pending.append(self._hello())
            self._send(pending, redis)
            pending = []

    def _seal(self, event: dict[bytes, bytes]) -> dict[bytes, bytes]:
        """``event`` numbered (here, in sending order: a router refuses a number not above the last) and signed."""
        self._seq += 1
        event[b"seq"] = str(self._seq).encode()
        if self._key is not None:
            event[SIG] = sign(self._key, event)
        return event

    def _send(self, events: list[dict[bytes, bytes]], redis) -> None:
        if not events:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for event in events:
                pipe.xadd(STREAM, self._seal(event), maxlen=MAX_EVENTS, approximate=True)
            pipe.execute()
            self.sent += len(events)
            if self._failing:
                logger.warning("kv events: the store answers again (%d events lost meanwhile)", self.failed)
            self._failing = False
        except redis.RedisError as exc:
            self.failed += len(events)
            if not self._failing:                # once per outage, not once per batch
                logger.warning("kv events: the store does not answer (%s); events are lost until it does", exc)
            self._failing = True

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (bounded by ``timeout``), then stop the thread and the connection."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.client.close()
