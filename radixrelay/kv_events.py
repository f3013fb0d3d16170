"""KV events through Redis: what each replica's radix tree holds, for routers that route precisely
(the publisher runs in a replica's scheduler, ``scheduler.kv_events``; the index in a router, ``router.app``).

A replica (``radixrelay serve --kv-events redis://HOST:PORT/DB``) appends to one Redis Stream
(``STREAM``), from a background thread (a step never waits for Redis; a full queue drops events and
counts them):

- ``hello``: its name (the URL routers know it by), a fresh instance id, the page-key namespace
  (model and KV layout) and page size. Again every ``HELLO_EVERY_S``.
- ``stored`` / ``removed``: page keys (``radixrelay.radix.page_keys``: each names a whole prefix, salt
  included) that entered its radix tree, or left it (evicted from the device).
- ``cleared``: its tree was emptied (``/flush_cache``).
- ``load``: requests running and waiting, KV use, every second (``scheduler.kv_events.LOAD_EVERY_S``).

Each router (``radixrelay router --mode precise --store redis://...``) reads the stream from its start
(so a restarted router rebuilds what it knew) and then as it grows, keeping per replica the keys it
holds; a new instance of a replica (a restart) replaces what its old one held. A prompt's held prefix
on a replica is its leading page keys, computed with that replica's namespace and page size under the
request's ``cache_salt``. The stream is trimmed to about ``MAX_EVENTS`` entries.

Fields are bytes; keys are concatenated ``KEY_BYTES``-byte digests.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from radixrelay.radix.page_keys import KEY_BYTES, chain_seed, extend_keys

logger = logging.getLogger("radixrelay.events")

STREAM = "radixrelay:kv-events"
MAX_EVENTS = 1_000_000
HELLO_EVERY_S = 30.0
QUEUE_EVENTS = 65536            # events a replica buffers before it drops (and counts) new ones
BATCH = 512                     # events per Redis round trip


def check_store_url(url: str) -> str:
    """``url`` if it is a ``redis://HOST:PORT/DB`` address; ``ValueError`` saying why not."""
    parts = urlsplit(url)
    if parts.scheme != "redis" or not parts.hostname:
        raise ValueError(f"store {url!r}: give a redis://HOST:PORT/DB URL, e.g. redis://127.0.0.1:6379/0")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"store {url!r}: the port is not a number in 0-65535") from None
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"store {url!r}: the database is a number, e.g. /0")
    return url


def connect(url: str, timeout: float = 2.0):
    """A Redis client for ``url``, checked with a PING; ``ConnectionError`` with the reason when the store
    does not answer."""
    import redis

    client = redis.Redis.from_url(check_store_url(url), socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ConnectionError(f"the store {url} does not answer: {exc}") from None
    return client


def _join(keys: list[bytes]) -> bytes:
    return b"".join(keys)


def _split(blob: bytes) -> list[bytes]:
    return [blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]


class KVEventPublisher:
    """A replica's side: ``stored``/``removed``/``cleared``/``load`` enqueue (never block); a thread sends."""

    def __init__(self, url: str, replica: str, namespace: str, page_size: int, queue_events: int = QUEUE_EVENTS) -> None:
        self.client = connect(url)
        self.replica, self.namespace, self.page_size = replica, namespace, page_size
        self.instance = uuid.uuid4().hex
        self.sent = 0
        self.dropped = 0
        self.failed = 0                         # events lost to a store that stopped answering
        self._queue: queue.Queue[dict[bytes, bytes] | None] = queue.Queue(queue_events)
        self._hello_at = 0.0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _event(self, kind: bytes, **fields: bytes) -> None:
        event = {b"kind": kind, b"replica": self.replica.encode(), b"instance": self.instance.encode(),
                 b"t": repr(time.time()).encode(), **{k.encode(): v for k, v in fields.items()}}
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def stored(self, keys: list[bytes]) -> None:
        if keys:
            self._event(b"stored", keys=_join(keys))

    def removed(self, keys: list[bytes]) -> None:
        if keys:
            self._event(b"removed", keys=_join(keys))

    def cleared(self) -> None:
        self._event(b"cleared")

    def load(self, running: int, waiting: int, kv_usage: float) -> None:
        self._event(b"load", load=json.dumps({"running": running, "waiting": waiting,
                                              "kv_usage": round(kv_usage, 4)}).encode())

    def _hello(self) -> dict[bytes, bytes]:
        self._hello_at = time.monotonic()
        return {b"kind": b"hello", b"replica": self.replica.encode(), b"instance": self.instance.encode(),
                b"t": repr(time.time()).encode(), b"namespace": self.namespace.encode(),
                b"page_size": str(self.page_size).encode()}

    def _run(self) -> None:
        import redis

        pending: list[dict[bytes, bytes]] = [self._hello()]
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                item = {}
            if item is None:
                break
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

    def _send(self, events: list[dict[bytes, bytes]], redis) -> None:
        if not events:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for event in events:
                pipe.xadd(STREAM, event, maxlen=MAX_EVENTS, approximate=True)
            pipe.execute()
            self.sent += len(events)
        except redis.RedisError as exc:
            self.failed += len(events)
            logger.warning("kv events: %d lost, the store does not answer (%s)", len(events), exc)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (bounded by ``timeout``), then stop the thread."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)


@dataclass
class ReplicaHoldings:
    instance: str = ""
    namespace: str = ""
    page_size: int = 0
    keys: set[bytes] = field(default_factory=set)
    load: dict = field(default_factory=dict)


class KVEventIndex:
    """A router's side: a thread reads the stream (from its start, then as it grows) into per-replica
    holdings; ``matched_tokens`` answers from them."""

    def __init__(self, url: str, block_ms: int = 200) -> None:
        self.client = connect(url)
        self.url = url
        self.block_ms = block_ms
        self.replicas: dict[str, ReplicaHoldings] = {}
        self.events = 0
        self.lag_s = 0.0                       # age of the last event applied when it was read
        self.last_id = b"0-0"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seeds: dict[tuple[str, str | None], bytes] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.catch_up()
        self._thread = threading.Thread(target=self._run, name="kv-index", daemon=True)
        self._thread.start()

    def catch_up(self, block_ms: int | None = None) -> int:
        """Apply the events after the last one read (waiting up to ``block_ms`` for one); returns how many."""
        import redis

        n = 0
        while True:
            try:
                batch = self.client.xread({STREAM: self.last_id}, count=4096, block=block_ms)
            except redis.RedisError as exc:
                logger.warning("kv events: the store does not answer (%s)", exc)
                return n
            if not batch:
                return n
            _, entries = batch[0]
            with self._lock:
                for event_id, fields in entries:
                    self._apply(fields)
                    self.last_id = event_id
            n += len(entries)
            block_ms = None
            if len(entries) < 4096:
                return n

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.catch_up(self.block_ms):
                self._stop.wait(0.05)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        self.events += 1
        kind = fields.get(b"kind", b"")
        name = fields.get(b"replica", b"").decode()
        instance = fields.get(b"instance", b"").decode()
        try:
            self.lag_s = max(0.0, time.time() - float(fields.get(b"t", b"0")))
        except ValueError:
            pass
        held = self.replicas.get(name)
        if held is None or held.instance != instance:
            if kind != b"hello" and held is not None:
                return                           # a stale event of an instance already replaced
            held = self.replicas[name] = ReplicaHoldings(instance=instance)
        if kind == b"hello":
            held.namespace = fields.get(b"namespace", b"").decode()
            held.page_size = int(fields.get(b"page_size", b"0") or 0)
        elif kind == b"stored":
            held.keys.update(_split(fields.get(b"keys", b"")))
        elif kind == b"removed":
            held.keys.difference_update(_split(fields.get(b"keys", b"")))
        elif kind == b"cleared":
            held.keys.clear()
        elif kind == b"load":
            try:
                held.load = json.loads(fields.get(b"load", b"{}"))
            except ValueError:
                pass

    def replica_names(self) -> list[str]:
        """Replicas that announced themselves (a ``hello`` read)."""
        with self._lock:
            return [name for name, held in self.replicas.items() if held.page_size]

    def reported_load(self, replica: str) -> int:
        """Requests running and waiting on ``replica`` as of its latest ``load`` event (0 before any)."""
        with self._lock:
            held = self.replicas.get(replica)
            load = held.load if held is not None else {}
        try:
            return int(load.get("running", 0)) + int(load.get("waiting", 0))
        except (TypeError, ValueError):
            return 0

    def holds(self, replica: str) -> int:
        with self._lock:
            held = self.replicas.get(replica)
            return len(held.keys) if held is not None else 0

    def matched_tokens(self, replica: str, token_ids: list[int], salt: str | None) -> int:
        """Leading tokens of ``token_ids`` (under ``salt``) whose pages ``replica`` holds, by its events."""
        return self.matched_tokens_many([replica], token_ids, salt)[0]

    def matched_tokens_many(self, replicas: list[str], token_ids: list[int], salt: str | None) -> list[int]:
        """``matched_tokens`` for each of ``replicas``; the prompt's page keys are computed once per
        (namespace, page size) the replicas use, not once per replica."""
        with self._lock:
            holdings = [self.replicas.get(name) for name in replicas]
            views = [(h.namespace, h.page_size, h.keys) if h is not None and h.page_size and h.keys else None
                     for h in holdings]
        keys_by_layout: dict[tuple[str, int], list[bytes]] = {}
        out = []
        for view in views:
            if view is None:
                out.append(0)
                continue
            namespace, ps, held = view
            seed = self._seeds.get((namespace, salt))
            if seed is None:
                seed = self._seeds[(namespace, salt)] = chain_seed(namespace, salt)
            keys = keys_by_layout.setdefault((namespace, ps), [])
            n, pages = 0, len(token_ids) // ps
            # hashed lazily: as far as the longest match among the replicas of this layout goes
            while n < pages:
                if n == len(keys):
                    extend_keys(keys, seed, token_ids, ps, n + 1)
                if keys[n] not in held:
                    break
                n += 1
            out.append(n * ps)
        return out
