"""The layout of a KV-event stream entry (``radixrelay.kv_events``), and its validation at the router.

An entry is a map of byte fields. Every entry has ``v`` (the layout's major version, ``VERSION``),
``kind``, ``replica`` (the URL routers know the replica by), ``instance`` (one per start of the
replica), ``t`` (Unix time when it was made), ``seq`` (1, 2, ... per instance, in stream order) and,
when the replicas sign (``radixrelay.kv_auth``), ``sig``. Kinds and their own fields:

- ``hello``: ``namespace`` (page keys' model and KV layout), ``page_size``;
- ``stored`` / ``removed``: ``keys``, concatenated ``KEY_BYTES``-byte page keys;
- ``cleared``: none;
- ``tier_stored`` / ``tier_removed``: ``tier`` (``host`` or ``disk``) and ``keys``: pages that entered or
  left a lower KV tier (host memory, disk) of the replica; ``stored``/``removed`` are the device's;
- ``tier_cleared``: ``tier``: the replica holds nothing in that tier any more (it then announces what it
  does hold: a snapshot, sent periodically and after events it could not keep track of);
- ``load``: ``load``, a JSON object of ``running``, ``waiting`` (requests) and ``kv_usage`` (0-1), and
  optionally the rates the replica measured while serving, in tokens per second: ``prefill_tps``
  (computing a prompt), ``host_load_tps`` (loading KV from host memory to the device) and
  ``disk_read_tps`` (reading it from disk into host memory).

``parse`` turns an entry into an ``Event`` or raises ``Rejected`` with a reason (a short label the router
counts by): types, ranges, finite numbers and sizes are checked, unknown fields are ignored (later
minor versions add some), an entry of a higher major version is refused. An entry without ``v`` is
version 0 (a replica from before versions: no ``seq``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from urllib.parse import urlsplit
from dataclasses import dataclass

from radixrelay.radix.page_keys import KEY_BYTES

VERSION = 1
KINDS = ("hello", "stored", "removed", "cleared", "load", "tier_stored", "tier_removed", "tier_cleared")
TIERS = ("host", "disk")
RATES = ("prefill_tps", "host_load_tps", "disk_read_tps")
MAX_RATE = 1e12                  # tokens per second
MAX_ENTRY_BYTES = 1 << 20        # all fields' names and values together
MAX_ENTRY_KEYS = 8192            # page keys in one stored/removed entry (the publisher splits longer lists)
MAX_NAME_BYTES = 256
MAX_NAMESPACE_BYTES = 64 << 10   # a namespace names the model's files: long for a model of many shards
MAX_PAGE_SIZE = 1 << 16
MAX_LOAD_BYTES = 1024
MAX_LOAD_COUNT = 1_000_000       # requests running or waiting on one replica
MAX_SEQ = (1 << 63) - 1
_INSTANCE = re.compile(rb"[A-Za-z0-9_-]{1,64}")
_NUMBER = re.compile(rb"[0-9]{1,20}")

# Reasons ``parse`` refuses an entry for (the index adds its own: signature, unknown replica, replay, ...).
PARSE_REASONS = ("size", "version", "kind", "replica", "instance", "t", "seq", "namespace", "page_size", "keys",
                 "load", "tier")


class Rejected(Exception):
    """An entry the router does not apply; ``reason`` is a short label (counted), ``detail`` says why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True, slots=True)
class Load:
    running: int
    waiting: int
    kv_usage: float
    prefill_tps: float | None = None       # the rates (``RATES``), tokens per second; None: not reported
    host_load_tps: float | None = None
    disk_read_tps: float | None = None


@dataclass(frozen=True, slots=True)
class Event:
    kind: str
    replica: str
    instance: str
    t: float
    seq: int | None                # None: a version-0 entry
    version: int
    namespace: str = ""            # hello
    page_size: int = 0             # hello
    keys: tuple[bytes, ...] = ()   # stored, removed, tier_stored, tier_removed
    tier: str = ""                 # tier_stored, tier_removed, tier_cleared: "host" or "disk"
    load: Load | None = None       # load


def split_keys(blob: bytes) -> tuple[bytes, ...]:
    return tuple(blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES))


def version_of(fields: Mapping[bytes, bytes]) -> int:
    """The entry's major version (0 without ``v``); ``Rejected`` when unreadable or above ``VERSION``."""
    raw = fields.get(b"v")
    if raw is None:
        return 0
    major = raw.split(b".", 1)[0]
    if not major.isdigit() or len(major) > 4:
        raise Rejected("version", f"v={raw[:16]!r} is not a version number")
    if int(major) > VERSION:
        raise Rejected("version", f"version {int(major)} is newer than this router's {VERSION}: upgrade the router")
    return int(major)


def parse(fields: Mapping[bytes, bytes]) -> Event:
    """The event of a stream entry; ``Rejected`` saying why it is not one."""
    size = sum(map(len, fields)) + sum(map(len, fields.values()))
    if size > MAX_ENTRY_BYTES:
        raise Rejected("size", f"{size} bytes, over {MAX_ENTRY_BYTES}")
    version = version_of(fields)
    kind = fields.get(b"kind", b"")
    if kind.decode("ascii", "replace") not in KINDS:
        raise Rejected("kind", f"kind={kind[:32]!r} is none of {', '.join(KINDS)}")
    instance = fields.get(b"instance", b"")
    if not _INSTANCE.fullmatch(instance):
        raise Rejected("instance", f"instance={instance[:80]!r} is not 1-64 letters, digits, '-' or '_'")
    common = dict(kind=kind.decode(), replica=_replica(fields.get(b"replica", b"")), instance=instance.decode(),
                  t=_time(fields.get(b"t", b"")), seq=_seq(fields.get(b"seq"), version), version=version)
    if kind == b"hello":
        return Event(**common, namespace=_namespace(fields.get(b"namespace", b"")),
                     page_size=_page_size(fields.get(b"page_size", b"")))
    if kind in (b"stored", b"removed"):
        return Event(**common, keys=_keys(fields.get(b"keys", b"")))
    if kind in (b"tier_stored", b"tier_removed"):
        return Event(**common, tier=_tier(fields.get(b"tier", b"")), keys=_keys(fields.get(b"keys", b"")))
    if kind == b"tier_cleared":
        return Event(**common, tier=_tier(fields.get(b"tier", b"")))
    if kind == b"load":
        return Event(**common, load=_load(fields.get(b"load", b"")))
    return Event(**common)


_NAMES: dict[bytes, str] = {}    # names checked already (a URL check is the costliest part of an entry's)
_MAX_NAMES = 4096


def _replica(raw: bytes) -> str:
    name = _NAMES.get(raw)
    if name is None:
        name = _check_replica(raw)
        if len(_NAMES) >= _MAX_NAMES:
            _NAMES.clear()
        _NAMES[raw] = name
    return name


def _check_replica(raw: bytes) -> str:
    if not raw or len(raw) > MAX_NAME_BYTES:
        raise Rejected("replica", f"the name is {len(raw)} bytes (1-{MAX_NAME_BYTES})")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Rejected("replica", f"the name {raw[:80]!r} is not UTF-8") from None
    if not name.isprintable():
        raise Rejected("replica", f"the name {name[:80]!r} has control characters")
    try:
        return check_replica_url(name)
    except ValueError as exc:
        raise Rejected("replica", str(exc)) from None


def _time(raw: bytes) -> float:
    try:
        t = float(raw) if 0 < len(raw) <= 32 else math.nan
    except ValueError:
        t = math.nan
    if not (math.isfinite(t) and t > 0):
        raise Rejected("t", f"t={raw[:32]!r} is not a positive finite Unix time")
    return t


def _seq(raw: bytes | None, version: int) -> int | None:
    if raw is None and version == 0:
        return None
    if raw is None or not _NUMBER.fullmatch(raw) or not 0 < int(raw) <= MAX_SEQ:
        raise Rejected("seq", f"seq={raw if raw is None else raw[:24]!r} is not a number in 1-{MAX_SEQ}")
    return int(raw)


def _namespace(raw: bytes) -> str:
    if not raw or len(raw) > MAX_NAMESPACE_BYTES:
        raise Rejected("namespace", f"the namespace is {len(raw)} bytes (1-{MAX_NAMESPACE_BYTES})")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Rejected("namespace", "the namespace is not UTF-8") from None


def _page_size(raw: bytes) -> int:
    if not _NUMBER.fullmatch(raw) or not 1 <= int(raw) <= MAX_PAGE_SIZE:
        raise Rejected("page_size", f"page_size={raw[:24]!r} is not a number in 1-{MAX_PAGE_SIZE}")
    return int(raw)


def _keys(raw: bytes) -> tuple[bytes, ...]:
    if not raw or len(raw) % KEY_BYTES or len(raw) > MAX_ENTRY_KEYS * KEY_BYTES:
        raise Rejected("keys", f"{len(raw)} bytes of keys: not 1-{MAX_ENTRY_KEYS} keys of {KEY_BYTES} bytes")
    return split_keys(raw)


def _tier(raw: bytes) -> str:
    tier = raw.decode("ascii", "replace")
    if tier not in TIERS:
        raise Rejected("tier", f"tier={raw[:16]!r} is none of {', '.join(TIERS)}")
    return tier


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number")


def _load(raw: bytes) -> Load:
    if len(raw) > MAX_LOAD_BYTES:
        raise Rejected("load", f"{len(raw)} bytes, over {MAX_LOAD_BYTES}")
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise Rejected("load", f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise Rejected("load", f"a JSON {type(value).__name__}, not an object")
    running = _count(value, "running")
    waiting = _count(value, "waiting")
    usage = value.get("kv_usage", 0.0)
    if not _number(usage) or not 0.0 <= usage <= 1.0:
        raise Rejected("load", f"kv_usage={str(usage)[:24]} is not a number in 0-1")
    rates = {}
    for name in RATES:
        rate = value.get(name)
        if rate is not None and (not _number(rate) or not 0 < rate <= MAX_RATE):
            raise Rejected("load", f"{name}={str(rate)[:24]} is not a number in (0, {MAX_RATE:g}]")
        rates[name] = None if rate is None else float(rate)
    return Load(running, waiting, float(usage), **rates)


def _number(value) -> bool:
    """A finite JSON number (not a bool; an int of any size: never converted to a float here)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _count(load: dict, name: str) -> int:
    value = load.get(name)
    if not _number(value) or not 0 <= value <= MAX_LOAD_COUNT:
        raise Rejected("load", f"{name}={str(value)[:24]} is not a number in 0-{MAX_LOAD_COUNT}")
    return int(value)


def check_replica_url(url: str) -> str:
    """``url`` without a trailing slash; ``ValueError`` saying why it is no replica address."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"replica {url!r}: give an http(s) URL with a host, e.g. http://127.0.0.1:30000")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"replica {url!r}: the port is not a number in 0-65535") from None
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(f"replica {url!r}: give the server's base URL (no path, query or fragment)")
    return url.rstrip("/")
