"""The router's side of KV events (``radixrelay.kv_events``): a thread reads the stream (from its start,
then as it grows) into per-replica holdings; ``matched_tokens`` answers from them.

Invariants (each a defence against what anyone with write access to the store can append):
- An entry is applied only if it parses (``radixrelay.kv_schema``), passes the router's trust
  (``radixrelay.router.trust``: a given or pattern-matched name, or a valid signature) and is new: its
  ``seq`` above the last applied of its instance (a replayed entry is refused), its instance the current
  one of its replica or a ``hello`` newer (signed time) than everything the current one sent. Any other
  entry is skipped, counted by reason (``rejected``) and logged once per reason; nothing an entry holds
  stops the reader, and a router restarted over the same stream starts.
- The reader never dies: every entry's failure is caught, the read loop runs under a supervisor that
  starts it again, and ``ensure_reader`` starts a new thread if that one ended. ``status`` says whether
  reads are advancing (``stalled`` after ``stall_s`` without a successful read: store down, thread stuck).
- Announcements expire: a replica whose newest ``hello``/``load`` is older than ``expire_s`` (its event
  time against this host's clock) has no reported load, and an announced (not given) one leaves
  ``replica_names`` and loses its holdings; at most ``max_announced`` announced names are tracked.

A prompt is looked up under each replica's own content keys (blake2b chained over its pages, a Python
step a page), computed once per layout (namespace, page size) and request, only as far as some replica's
match goes, and remembered (``KeyMemo``) so that the next prompt over the same document reuses them: a
remembered prompt is found by 64-bit chained page hashes (``radixrelay.radix.page_hash``, one numpy pass)
and confirmed by comparing the token arrays, so a hash collision can cost a lookup, never a wrong key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice, takewhile

import numpy as np

from radixrelay.kv_auth import verify
from radixrelay.kv_schema import PARSE_REASONS, Event, Load, Rejected, parse, version_of
from radixrelay.kv_store import STREAM, connect
from radixrelay.radix.page_hash import chain_hashes, seed_of
from radixrelay.radix.page_keys import chain_seed, extend_keys
from radixrelay.radix.tokens import as_tokens, first_difference
from radixrelay.router.trust import Trust

logger = logging.getLogger("radixrelay.events")

STALL_S = 5.0            # no successful read for this long: the reader is stalled (the router routes approximately)
EXPIRE_S = 10.0          # a replica silent (no hello or load) for this long: its load and announcement expire
MAX_SKEW_S = 60.0        # entries dated further ahead of this host's clock are refused
MAX_ANNOUNCED = 256      # announced (not given) replica names tracked at once
MAX_REPLICA_KEYS = 1 << 22   # page keys held per replica, all tiers (a replica's tiers hold far fewer)
_NONE: frozenset[bytes] = frozenset()
READ_COUNT = 1024        # entries per read round trip
RETRY_S = 0.5            # pause after a failed read (store down) or a reader failure
EXPIRE_EVERY_S = 1.0
MAX_SEEDS = 4096         # (namespace, salt) chain seeds cached (salts come from clients: bounded)
MEMO_PAGES = 1 << 18     # replicas' page keys remembered across requests (KeyMemo), all layouts together
MEMO_EVERY = 32          # a remembered prompt is found again at every this many pages
REASONS = PARSE_REASONS + ("signature", "unknown_replica", "replay", "stale_instance", "too_many_replicas",
                           "internal")


@dataclass
class ReplicaHoldings:
    """What one replica's current instance told (guarded by the index's lock)."""
    instance: str = ""
    seq: int = 0                   # newest seq applied (0: none, or version-0 entries)
    newest_t: float = 0.0          # newest event time applied: a new instance's hello must be later
    heard_t: float = 0.0           # newest hello or load time: freshness
    load_t: float = 0.0
    namespace: str = ""
    page_size: int = 0
    keys: set[bytes] = field(default_factory=set)           # on the device (its radix tree)
    host: set[bytes] = field(default_factory=set)           # in its host-memory tier
    disk: set[bytes] = field(default_factory=set)           # in its disk tier
    load: Load | None = None

    def tier(self, name: str) -> set[bytes]:
        return self.host if name == "host" else self.disk

    def num_keys(self) -> int:
        return len(self.keys) + len(self.host) + len(self.disk)


@dataclass(frozen=True)
class ReaderStatus:
    reader: str                            # "ok" or "stalled"
    seconds_since_read: float | None       # since the last successful read round trip (None: none yet)
    restarts: int                          # reader loops restarted after a failure
    events: int                            # entries read
    rejected: int                          # entries refused (all reasons)

    def as_json(self) -> dict:
        since = None if self.seconds_since_read is None else round(self.seconds_since_read, 3)
        return {"reader": self.reader, "seconds_since_read": since, "restarts": self.restarts,
                "events": self.events, "rejected": self.rejected}


class KVEventIndex:
    def __init__(self, url: str, block_ms: int = 200, *, trust: Trust = Trust(), password: str | None = None,
                 stall_s: float = STALL_S, expire_s: float = EXPIRE_S, max_announced: int = MAX_ANNOUNCED) -> None:
        self.client = connect(url, password=password)
        self.url = url
        self.block_ms = block_ms
        self.trust = trust
        self.stall_s, self.expire_s, self.max_announced = stall_s, expire_s, max_announced
        self.replicas: dict[str, ReplicaHoldings] = {}
        self.events = 0
        self.rejected: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.restarts = 0
        self.lag_s = 0.0                       # age of the last event applied when it was read
        self.last_id = b"0-0"
        self._read_at: float | None = None     # monotonic time of the last successful read round trip
        self._expired_at = 0.0
        self._store_down = False
        self._logged: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seeds: dict[tuple[str, str | None], bytes] = {}
        self.memo = KeyMemo()                  # replicas' content keys of recent prompts
        self._thread: threading.Thread | None = None

    # -- reading ---------------------------------------------------------------------------------

    def start(self) -> None:
        """What the stream holds so far (never raises: a failure here is the reader's to retry), then a
        reader thread."""
        try:
            self.catch_up()
        except Exception as exc:  # noqa: BLE001 - a router starts whatever the stream holds
            self.restarts += 1
            self._log_once("reader", "kv events: the first read failed (%s: %s); the reader tries again",
                           type(exc).__name__, exc)
        self._thread = threading.Thread(target=self._supervise, name="kv-index", daemon=True)
        self._thread.start()

    def catch_up(self, block_ms: int | None = None) -> int:
        """Apply the entries after the last one read (waiting up to ``block_ms`` for one); returns how many
        were read. A store that does not answer is logged (once until it answers again), not raised."""
        import redis

        n = 0
        while True:
            try:
                batch = self.client.xread({STREAM: self.last_id}, count=READ_COUNT, block=block_ms)
            except redis.RedisError as exc:
                if not self._store_down:
                    logger.warning("kv events: the store does not answer (%s); routing approximately meanwhile", exc)
                self._store_down = True
                return n
            if self._store_down:
                logger.warning("kv events: the store answers again")
                self._store_down = False
            self._read_at = time.monotonic()
            entries = batch[0][1] if batch else []
            with self._lock:
                for event_id, fields in entries:
                    self._apply_entry(fields)
                    self.last_id = event_id
                if time.monotonic() - self._expired_at >= EXPIRE_EVERY_S:
                    self._expire(time.time())
            n += len(entries)
            block_ms = None
            if len(entries) < READ_COUNT:
                return n

    def _supervise(self) -> None:
        while not self._stop.is_set():
            try:
                self._read_loop()
            except Exception as exc:  # noqa: BLE001 - a bug must not end the reader: logged, started again
                self.restarts += 1
                self._log_once("reader", "kv events: the reader failed (%s: %s); it starts again (counted in "
                               "radixrelay_router_kv_events_reader_restarts_total)",
                               type(exc).__name__, exc)
                self._stop.wait(RETRY_S)

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            if not self.catch_up(self.block_ms):
                self._stop.wait(RETRY_S if self._store_down else 0.05)

    def ensure_reader(self) -> None:
        """Start a new reader thread if the running one ended (``start`` called, ``close`` not)."""
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stop.is_set():
            self.restarts += 1
            logger.warning("kv events: the reader thread ended; starting a new one")
            self._thread = threading.Thread(target=self._supervise, name="kv-index", daemon=True)
            self._thread.start()

    def _since_read(self) -> float | None:
        read_at = self._read_at
        return None if read_at is None else time.monotonic() - read_at

    def stalled(self) -> bool:
        """No successful read round trip for ``stall_s`` (or none yet); a reader thread that ended is
        started again first. Cheap: asked on every routed request."""
        self.ensure_reader()
        since = self._since_read()
        return since is None or since > self.stall_s

    def status(self) -> ReaderStatus:
        stalled = self.stalled()
        return ReaderStatus("stalled" if stalled else "ok", self._since_read(), self.restarts, self.events,
                            sum(self.rejected.values()))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        self.client.close()

    # -- applying --------------------------------------------------------------------------------

    def _log_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning(message + " (logged once)", *args)

    def _apply_entry(self, fields: Mapping[bytes, bytes]) -> None:
        self.events += 1
        try:
            self._apply(fields)
        except Rejected as exc:
            self.rejected[exc.reason] += 1
            self._log_once(exc.reason, "kv events: an entry skipped, %s (counted in "
                           "radixrelay_router_kv_events_rejected_total)", exc)
        except Exception as exc:  # noqa: BLE001 - whatever an entry holds, the reader goes on
            self.rejected["internal"] += 1
            self._log_once("internal", "kv events: an entry skipped, it failed to apply (%s: %s; counted in "
                           "radixrelay_router_kv_events_rejected_total)",
                           type(exc).__name__, exc)

    def _apply(self, fields: Mapping[bytes, bytes]) -> None:
        version_of(fields)                               # a newer major version: refused before its signature
        if self.trust.key is not None and not verify(self.trust.key, fields):
            raise Rejected("signature", "no valid signature under the router's --store-key-file")
        event = parse(fields)
        name = event.replica
        if not self.trust.admits(name):
            raise Rejected("unknown_replica", f"{name} is no --replica and does not match --replica-pattern")
        now = time.time()
        if event.t > now + MAX_SKEW_S:
            raise Rejected("t", f"t={event.t} is more than {MAX_SKEW_S:.0f} s ahead of this host's clock")
        held = self._holdings(event, now)
        if event.seq is not None:
            if event.seq <= held.seq:
                raise Rejected("replay", f"{name} instance {event.instance}: seq {event.seq} was applied already")
            held.seq = event.seq
        self.lag_s = max(0.0, now - event.t)
        held.newest_t = max(held.newest_t, event.t)
        if event.kind == "hello":
            held.namespace, held.page_size = event.namespace, event.page_size
            held.heard_t = max(held.heard_t, event.t)
        elif event.kind in ("stored", "tier_stored"):
            if held.num_keys() + len(event.keys) > MAX_REPLICA_KEYS:
                raise Rejected("keys", f"{name} holds {held.num_keys()} page keys; at most {MAX_REPLICA_KEYS} are kept")
            (held.keys if event.kind == "stored" else held.tier(event.tier)).update(event.keys)
        elif event.kind == "removed":
            held.keys.difference_update(event.keys)
        elif event.kind == "tier_removed":
            held.tier(event.tier).difference_update(event.keys)
        elif event.kind == "cleared":
            held.keys.clear()
        elif event.kind == "tier_cleared":
            held.tier(event.tier).clear()
        elif event.kind == "load" and event.t >= held.load_t:
            held.load, held.load_t = event.load, event.t
            held.heard_t = max(held.heard_t, event.t)

    def _holdings(self, event: Event, now: float) -> ReplicaHoldings:
        """The holdings ``event`` applies to: its replica's current instance's, a new instance's (a newer
        hello), or a new replica's (within the bound on announced names); ``Rejected`` otherwise."""
        name = event.replica
        held = self.replicas.get(name)
        if held is None:
            if name not in self.trust.given and self._announced() >= self.max_announced:
                self._forget_expired(now)
                if self._announced() >= self.max_announced:
                    raise Rejected("too_many_replicas", f"{name}: {self.max_announced} announced replicas tracked "
                                                        "already")
            held = self.replicas[name] = ReplicaHoldings(instance=event.instance)
        elif held.instance != event.instance:
            if event.kind != "hello" or event.t <= held.newest_t:
                raise Rejected("stale_instance", f"{name}: an entry of instance {event.instance}, not newer than "
                                                 f"the current one ({held.instance})")
            held = self.replicas[name] = ReplicaHoldings(instance=event.instance)
        return held

    def _announced(self) -> int:
        return sum(1 for name in self.replicas if name not in self.trust.given)

    def _fresh(self, held: ReplicaHoldings, now: float) -> bool:
        return now - held.heard_t <= self.expire_s

    def _expire(self, now: float) -> None:
        """Announced replicas gone silent lose their holdings (the header stays: replay protection)."""
        self._expired_at = time.monotonic()
        for name, held in self.replicas.items():
            if name not in self.trust.given and not self._fresh(held, now) and (held.num_keys() or held.load):
                held.keys, held.host, held.disk, held.load = set(), set(), set(), None

    def _forget_expired(self, now: float) -> None:
        """Forget silent announced replicas entirely, the longest silent first, to make room for one."""
        silent = sorted((held.heard_t, name) for name, held in self.replicas.items()
                        if name not in self.trust.given and not self._fresh(held, now))
        for _, name in silent[:max(1, len(silent) // 2)]:
            del self.replicas[name]

    # -- answers ---------------------------------------------------------------------------------

    def replica_names(self) -> list[str]:
        """Announced replicas that may join the pool: not given, a ``hello`` read, heard from within
        ``expire_s``."""
        now = time.time()
        with self._lock:
            return [name for name, held in self.replicas.items()
                    if name not in self.trust.given and held.page_size and self._fresh(held, now)]

    def reported_load(self, replica: str) -> int:
        """Requests running and waiting on ``replica`` as of its latest ``load`` event (0 before any, or
        when that is older than ``expire_s``)."""
        with self._lock:
            held = self.replicas.get(replica)
            if held is None or held.load is None or time.time() - held.load_t > self.expire_s:
                return 0
            return held.load.running + held.load.waiting

    def reported_rates(self, replica: str) -> Load | None:
        """``replica``'s latest ``load`` event (its measured rates), None before any or when stale."""
        with self._lock:
            held = self.replicas.get(replica)
            if held is None or held.load is None or time.time() - held.load_t > self.expire_s:
                return None
            return held.load

    def holds(self, replica: str) -> int:
        with self._lock:
            held = self.replicas.get(replica)
            return len(held.keys) if held is not None else 0

    def matched_tokens(self, replica: str, token_ids: Sequence[int] | np.ndarray, salt: str | None) -> int:
        """Leading tokens of ``token_ids`` (under ``salt``) whose pages ``replica`` holds, by its events."""
        return self.matched_tokens_many([replica], token_ids, salt)[0]

    def matched_tokens_many(self, replicas: list[str], token_ids: Sequence[int] | np.ndarray,
                            salt: str | None) -> list[int]:
        """``matched_tokens`` for each of ``replicas``; the prompt's page keys are computed once per
        (namespace, page size) the replicas use, not once per replica, only as far as the longest match
        among them goes, after those ``KeyMemo`` remembers."""
        return [device for device, _, _ in self.matched_tiers_many(replicas, token_ids, salt, tiers=False)]

    def matched_tiers_many(self, replicas: list[str], token_ids: Sequence[int] | np.ndarray,
                           salt: str | None, tiers: bool = True) -> list[tuple[int, int, int]]:
        """For each of ``replicas``: (tokens of the prompt's leading pages on its device, then of the pages
        after those in its host-memory tier or on its disk: host, disk). A page on disk only is read into
        host memory first; the walk stops at the first page no tier holds (``tiers`` False: at the first
        not on the device)."""
        with self._lock:
            holdings = [self.replicas.get(name) for name in replicas]
            views = [(h.namespace, h.page_size, h.keys, h.host if tiers else _NONE, h.disk if tiers else _NONE)
                     if h is not None and h.page_size and (h.keys or (tiers and (h.host or h.disk))) else None
                     for h in holdings]
        tokens = as_tokens(token_ids)
        # layout -> (keys, how many the memo gave, the memo's marks of the prompt)
        found: dict[tuple[str, int], tuple[list[bytes], int, list[int] | None]] = {}
        out = []
        for view in views:
            if view is None:
                out.append((0, 0, 0))
                continue
            namespace, ps, held, host, disk = view
            layout = (namespace, ps)
            if layout not in found:
                keys, marks = self.memo.keys((namespace, ps, salt), tokens)
                found[layout] = (keys, len(keys), marks)
            keys = found[layout][0]
            seed, pages = self._seed(namespace, salt), len(tokens) // ps
            n = self._run(keys, 0, pages, held.__contains__, seed, tokens, ps)
            on_host = on_disk = 0
            if host or disk:                     # pages past the device's in a lower tier: host first
                tier = n
                while tier < pages:
                    in_host = self._run(keys, tier, pages, host.__contains__, seed, tokens, ps)
                    on_host += in_host - tier
                    in_disk = self._run(keys, in_host, pages, disk.__contains__, seed, tokens, ps)
                    on_disk += in_disk - in_host
                    if in_disk == tier:
                        break
                    tier = in_disk
            out.append((n * ps, on_host * ps, on_disk * ps))
        for (namespace, ps), (keys, remembered, marks) in found.items():
            self.memo.remember((namespace, ps, salt), tokens, keys, marks, remembered)
        return out

    @staticmethod
    def _run(keys: list[bytes], n: int, pages: int, held, seed: bytes, tokens: np.ndarray, ps: int) -> int:
        """The end of the run of pages from ``n`` on whose keys ``held`` says yes to; ``keys`` hashed as
        far as the run goes, in growing steps."""
        while n < pages:
            if n == len(keys):
                extend_keys(keys, seed, tokens, ps, min(pages, n + 4 + n // 4))
            n += len(list(takewhile(held, islice(keys, n, None))))   # at C speed
            if n < len(keys):
                break
        return n

    def _seed(self, namespace: str, salt: str | None) -> bytes:
        seed = self._seeds.get((namespace, salt))
        if seed is None:
            if len(self._seeds) >= MAX_SEEDS:
                self._seeds.clear()
            seed = self._seeds[(namespace, salt)] = chain_seed(namespace, salt)
        return seed


Layout = tuple[str, int, str | None]          # (namespace, page size, salt): what a replica's keys depend on


@dataclass(eq=False)
class _Remembered:
    layout: Layout
    tokens: np.ndarray                         # int32: the prompt whose leading pages' keys these are
    keys: list[bytes]
    marks: list[int]                           # its hashes at every ``every`` pages (its index entries)


class KeyMemo:
    """Replicas' content keys of recent prompts' leading pages, by layout, at most ``max_pages`` keys in all
    (least recently used prompts forgotten first). A prompt is found by the 64-bit chained hashes of its
    pages at every ``every`` pages (``radixrelay.radix.page_hash``, seeded by the layout), the longest
    first, and taken only if its tokens equal the new prompt's over those pages (one array compare)."""

    def __init__(self, max_pages: int = MEMO_PAGES, every: int = MEMO_EVERY) -> None:
        self.max_pages, self.every = max_pages, every
        self._entries: OrderedDict[int, _Remembered] = OrderedDict()     # id -> entry, least recent first
        self._index: dict[tuple[Layout, int], int] = {}                  # (layout, hash at a mark) -> id
        self._ids = 0
        self._pages = 0
        self._seeds: dict[Layout, int] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = self.collisions = 0

    def _marks(self, layout: Layout, tokens: np.ndarray, num_pages: int) -> list[int]:
        """The chained hashes of ``tokens``' pages ``every - 1, 2 * every - 1, ...`` below ``num_pages``."""
        seed = self._seeds.get(layout)
        if seed is None:
            if len(self._seeds) >= MAX_SEEDS:
                self._seeds.clear()
            seed = self._seeds[layout] = seed_of(layout[0], str(layout[1]), layout[2])
        ps = layout[1]
        upto = num_pages - num_pages % self.every
        return chain_hashes(tokens[:upto * ps], ps, seed)[self.every - 1::self.every].tolist()

    def keys(self, layout: Layout, tokens: np.ndarray) -> tuple[list[bytes], list[int] | None]:
        """Remembered keys of ``tokens``' leading pages (a new list, possibly empty), and the marks of
        ``tokens`` computed to find them (for ``remember``; None if none were)."""
        ps = layout[1]
        if not self._entries or len(tokens) // ps < self.every:
            return [], None
        marks = self._marks(layout, tokens, len(tokens) // ps)
        with self._lock:
            for m in range(len(marks) - 1, -1, -1):
                entry_id = self._index.get((layout, marks[m]))
                if entry_id is None:
                    continue
                entry = self._entries.get(entry_id)
                n = (m + 1) * self.every               # pages
                if entry is None or entry.layout != layout or len(entry.keys) < n:
                    continue
                same = first_difference(entry.tokens[:n * ps], tokens[:n * ps])
                if same < n * ps:                      # a 64-bit collision: never trusted
                    self.collisions += 1
                    n = same // ps
                    if n < self.every:
                        continue
                self._entries.move_to_end(entry_id)
                self.hits += 1
                return entry.keys[:n], marks
            self.misses += 1
        return [], marks

    def remember(self, layout: Layout, tokens: np.ndarray, keys: list[bytes], marks: list[int] | None = None,
                 known: int = 0) -> None:
        """``keys`` are the keys of ``tokens``' first ``len(keys)`` pages under ``layout``; ``marks``: what
        ``keys`` computed for ``tokens`` if it did; ``known``: how many of ``keys`` it gave (a prompt that
        adds less than ``every`` pages to a remembered one is not remembered again)."""
        ps = layout[1]
        n = len(keys) - len(keys) % self.every
        if n <= known or n > self.max_pages:
            return
        marks = self._marks(layout, tokens, n) if marks is None else marks[:n // self.every]
        with self._lock:
            self._ids += 1
            self._entries[self._ids] = _Remembered(layout, tokens[:n * ps], keys[:n], marks)
            self._pages += n
            for mark in marks:
                self._index[(layout, mark)] = self._ids
            while self._pages > self.max_pages:
                old_id, old = self._entries.popitem(last=False)
                self._pages -= len(old.keys)
                for mark in old.marks:
                    if self._index.get((old.layout, mark)) == old_id:
                        del self._index[(old.layout, mark)]
