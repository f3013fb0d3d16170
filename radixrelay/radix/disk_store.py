"""Disk tier of the KV cache: one file per KV page, verified on every read.

A page is the K/V of ``page_size`` tokens across all layers, identified by a 16-byte content key
(a chained blake2b digest computed by the caller; it already covers the cache salt and the model /
layout namespace). Pure Python, no torch: meant to be driven from one worker thread.

Layout: ``<root>/<hex(blake2b(namespace, digest_size=16))>/<hex key>.kv``. The namespace string names
the model and KV layout, so a restart with another model or page size uses another directory and
never sees these files. The directory is 0o700 and page files are 0o600 whatever the umask.

File format (little endian, ``HEADER``, then the raw payload bytes)::

    magic   4s   b"RRKV"
    version u16  FORMAT_VERSION
    ns      16s  namespace digest (a file moved into another namespace directory fails to verify)
    key     16s  the page key (a file renamed to another key fails to verify)
    length  u64  payload length; the file size must be exactly HEADER.size + length
    crc     u32  zlib.crc32 of the payload

Invariants:
- A ``<hex key>.kv`` file only ever appears whole: ``write`` fills a private temp file
  (``.<hex key>.<random>.tmp``, O_EXCL|O_NOFOLLOW, 0o600) and ``os.replace``s it into place, which
  also replaces (never writes through) a symlink planted at the final path. There is no fsync: after
  a power loss a file may be torn or zero-filled, which the header + checksum catch on read.
- ``read_into`` returns True only if every header field and the payload checksum verify; it never
  raises for a bad file. A truncated or corrupt file is deleted. A valid file whose payload length
  differs from ``len(out)`` is a caller mismatch: False, and the file is kept. On False the contents
  of ``out`` are unspecified (it may hold part of the payload).
- ``scan`` trusts names and sizes only (no payload reads, cheap at start-up) and removes leftover
  temp files; it assumes one process owns the namespace directory at a time.
- Only regular files owned by the effective uid are ever read. A page path is opened with
  O_NOFOLLOW|O_NONBLOCK, so opening never blocks (a FIFO) or follows a symlink, and the open file
  is checked with fstat before any read; anything else in its place (a FIFO, symlink, directory,
  device, socket, another user's file) is a miss, counted in ``refused`` and logged once per store.
  Such an entry is removed unless it is a directory.
- The root directory is used only if it is a real directory (not a symlink) owned by the effective
  uid and not writable by group or others (``check_directory``); it is never chmod-ed when it
  exists, since it may be shared. The namespace directory below it is ours: it must be a real
  directory owned by the effective uid and is kept at 0o700.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import pathlib
import re
import secrets
import shutil
import stat
import struct
import zlib

MAGIC = b"RRKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sH16s16sQI")  # 50 bytes
KEY_LEN = 16
_NAME_RE = re.compile(r"[0-9a-f]{32}\.kv")
_TMP_SUFFIX = ".tmp"
# Checksum: CRC-32 is the fastest of the standard library's (zlib's adler32, hashlib's digests) and
# detects every single-bit error (and every burst up to 32 bits); adler32 is slower and weaker.
# Tampering is out of scope: the directory is 0o700.
_checksum = zlib.crc32
# Opening never blocks (a FIFO waits for a writer otherwise), never follows a symlink and never makes
# a terminal the controlling one; what was opened is checked with fstat before it is read.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

logger = logging.getLogger(__name__)


def unsafe_directory(path: str | os.PathLike) -> str | None:
    """Why the existing ``path`` is no safe place for KV page files, or None: it must be a real
    directory (not a symlink), owned by the effective uid, not writable by group or others. A
    missing ``path`` is safe (it is created 0o700)."""
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return (f"{path!r} is a symbolic link; pass the real directory (after checking its owner and "
                f"mode) or a new path")
    if not stat.S_ISDIR(st.st_mode):
        return f"{path!r} exists and is not a directory"
    uid = os.geteuid()
    if st.st_uid != uid:
        return (f"{path!r} is owned by uid {st.st_uid}, not by this process's uid {uid}; use a directory "
                f"of your own, or `chown {uid} {path}` if it is meant for this server")
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if mode & bit)
        return (f"{path!r} is writable by {who} (mode {mode:#o}): anyone who can write there can plant "
                f"or swap page files; run `chmod 700 {path}` or use another directory")
    return None


def check_directory(path: str | os.PathLike) -> None:
    """Raise ValueError (saying why and how to fix it) if ``path`` is unsafe (``unsafe_directory``)."""
    why = unsafe_directory(path)
    if why is not None:
        raise ValueError(f"disk KV directory {why}")


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_LEN:
        raise ValueError(f"DiskKVStore: key must be {KEY_LEN} bytes, got {key!r:.60}")
    return bytes(key)


def rank_namespace(namespace: str, rank: int, size: int) -> str:
    """The directory namespace of tensor-parallel rank ``rank`` of ``size``: each rank keeps its own
    KV heads in its own directory, under the page keys every rank shares (``namespace`` at ``size`` 1)."""
    return namespace if size == 1 else f"{namespace};rank={rank}/{size}"


class DiskKVStore:
    def __init__(self, root: str | os.PathLike, namespace: str) -> None:
        root = pathlib.Path(root)
        check_directory(root)
        if not root.exists():
            os.makedirs(root, mode=0o700, exist_ok=True)
            os.chmod(root, 0o700)  # makedirs' mode is masked by the umask
            check_directory(root)
        self._uid = os.geteuid()
        self._ns_digest = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self._root = root
        self._dir = root / self._ns_digest.hex()
        self._make_dir()
        self.refused = 0        # non-regular or foreign entries found in place of a page file
        self.recreated = 0      # times the directory was found removed while serving and made again

    def _make_dir(self) -> None:
        """Create the namespace directory (0o700), or check the existing one is ours."""
        try:
            os.mkdir(self._dir, 0o700)
        except FileExistsError:
            st = os.lstat(self._dir)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != self._uid:
                raise ValueError(f"DiskKVStore: {str(self._dir)!r} exists and is not a directory owned by "
                                 f"uid {self._uid}; remove it") from None
        os.chmod(self._dir, 0o700)

    @property
    def directory(self) -> pathlib.Path:
        return self._dir

    def _path(self, key: bytes) -> str:
        return os.path.join(self._dir, key.hex() + ".kv")

    def file_bytes(self, payload_len: int) -> int:
        return HEADER.size + payload_len

    def scan(self) -> dict[bytes, int]:
        found: dict[bytes, int] = {}
        with os.scandir(self._dir) as entries:
            for entry in entries:
                name = entry.name
                try:
                    if name.startswith(".") and name.endswith(_TMP_SUFFIX):
                        os.unlink(entry.path)  # left by a crash mid-write
                    elif _NAME_RE.fullmatch(name) and entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        if st.st_size >= HEADER.size and st.st_uid == self._uid:
                            found[bytes.fromhex(name[:32])] = st.st_size - HEADER.size
                except OSError:
                    continue
        return found

    def write(self, key: bytes, data) -> int:
        key = _check_key(key)
        payload = memoryview(data).cast("B")
        header = HEADER.pack(MAGIC, FORMAT_VERSION, self._ns_digest, key, len(payload), _checksum(payload))
        tmp = os.path.join(self._dir, f".{key.hex()}.{secrets.token_hex(8)}{_TMP_SUFFIX}")
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:      # the directory was removed while serving: made again (as checked at start)
            if unsafe_directory(self._root) is not None:
                raise
            os.makedirs(self._root, mode=0o700, exist_ok=True)
            self._make_dir()
            self.recreated += 1
            logger.warning("disk KV tier: %s was removed while serving; created again", self._dir)
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                for chunk in (memoryview(header), payload):
                    while chunk:
                        chunk = chunk[os.write(fd, chunk):]
            finally:
                os.close(fd)
            os.replace(tmp, self._path(key))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return HEADER.size + len(payload)

    def read_into(self, key: bytes, out) -> bool:
        key = _check_key(key)
        view = memoryview(out).cast("B")
        if view.readonly:
            raise ValueError("DiskKVStore.read_into: out must be a writable buffer")
        path = self._path(key)
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return False
        except OSError:  # ELOOP: a symlink; ENXIO: a socket; or EMFILE, EIO, ... on a file of ours
            try:
                st = os.lstat(path)
            except OSError:
                return False
            if stat.S_ISREG(st.st_mode) and st.st_uid == self._uid:
                return False
            return self._refuse(path, st, _kind(st))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != self._uid:
                os.close(fd)
                return self._refuse(path, st, _kind(st))
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except OSError:
            os.close(fd)
            return False
        try:
            with os.fdopen(fd, "rb", buffering=0) as f:
                if st.st_size < HEADER.size:
                    return self._drop(path, st)
                header = bytearray(HEADER.size)
                if f.readinto(header) != HEADER.size:
                    return self._drop(path, st)
                magic, version, ns, file_key, length, crc = HEADER.unpack(header)
                if (magic != MAGIC or version != FORMAT_VERSION or ns != self._ns_digest
                        or file_key != key or st.st_size != HEADER.size + length):
                    return self._drop(path, st)
                if length != len(view):
                    return False  # the caller expected another size: the file itself is fine, keep it
                pos = 0
                while pos < length:  # normally a single read() straight into `out`
                    n = f.readinto(view[pos:])
                    if not n:
                        return self._drop(path, st)
                    pos += n
                if _checksum(view) != crc:
                    return self._drop(path, st)
                return True
        except OSError:
            return False

    def _refuse(self, path: str, st: os.stat_result, what: str) -> bool:
        """``path`` is not a regular file of ours: count it, log the first one, remove it unless it is a
        directory (or was replaced since ``st``); return False."""
        self.refused += 1
        log = logger.warning if self.refused == 1 else logger.debug
        log("disk KV tier: %s in place of a page file (%s): a miss, the entry is removed unless it is a "
            "directory; only this server's regular files are read from %s", path, what, self._dir)
        try:
            now = os.lstat(path)
            if not stat.S_ISDIR(now.st_mode) and (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
        except OSError:
            pass
        return False

    def _drop(self, path: str, st: os.stat_result) -> bool:
        """Delete the corrupt file at ``path`` unless it was replaced since we opened it; return False."""
        try:
            now = os.lstat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
        except OSError:
            pass
        return False

    def delete(self, key: bytes) -> None:
        key = _check_key(key)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass


def _kind(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return f"a file owned by uid {st.st_uid}"


DEFAULT_DISK_GIB = 64.0   # a disk tier's capacity when none is given, if the space available allows
DISK_SHARE = 0.9          # of the space available, what a default capacity (or a refusal's advice) takes


def available_bytes(path: str) -> tuple[int, int]:
    """(free bytes of the filesystem holding ``path``, or of its nearest existing parent; bytes of the files
    already under ``path``, pages of an earlier run that this one reuses or deletes)."""
    where = pathlib.Path(path).expanduser().absolute()
    existing = where
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    kept = 0
    if where.is_dir():
        for root, _, files in os.walk(where):
            for name in files:
                try:
                    kept += os.lstat(os.path.join(root, name)).st_size
                except OSError:
                    pass          # removed meanwhile
    return free, kept


def disk_tier_gib(path: str, gib: float | None) -> float:
    """The disk tier's capacity in GiB: ``gib`` when given (checked at start-up by
    ``runtime.preflight.check_disk_space``), else ``DEFAULT_DISK_GIB`` or ``DISK_SHARE`` of the space
    available under ``path``, whichever is less."""
    if gib is not None:
        return gib
    free, kept = available_bytes(path)
    return min(DEFAULT_DISK_GIB, DISK_SHARE * (free + kept) / (1 << 30))
