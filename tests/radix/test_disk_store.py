import logging
import os
import socket
import stat
import threading

import numpy as np
import pytest

from radixrelay.config import EngineConfig
from radixrelay.radix.disk_store import HEADER, DiskKVStore

NS = "model=tiny;page_size=16;layers=30;kv_heads=3;head_dim=64;dtype=float32"
KEY = bytes(range(16))
KEY2 = bytes(range(16, 32))


def _payload(n=4096, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def store(tmp_path):
    return DiskKVStore(tmp_path / "kv", NS)


def _file(store, key=KEY):
    return store.directory / (key.hex() + ".kv")


def test_round_trip_bytes(store):
    data = _payload(300_000)
    n = store.write(KEY, data)
    assert n == HEADER.size + len(data) == store.file_bytes(len(data))
    assert _file(store).stat().st_size == n
    out = bytearray(len(data))
    assert store.read_into(KEY, out)
    assert bytes(out) == data


def test_round_trip_numpy(store):
    arr = np.random.default_rng(1).standard_normal((2, 30, 16, 3, 64)).astype(np.float32)
    assert store.write(KEY, arr) == HEADER.size + arr.nbytes
    out = np.empty_like(arr)
    assert store.read_into(KEY, out)
    np.testing.assert_array_equal(out, arr)


def test_overwrite_replaces_contents(store):
    store.write(KEY, _payload(1000, seed=1))
    new = _payload(1000, seed=2)
    store.write(KEY, new)
    out = bytearray(1000)
    assert store.read_into(KEY, out) and bytes(out) == new


def test_modes_with_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        s = DiskKVStore(tmp_path / "a" / "root", NS)
        s.write(KEY, _payload(100))
        # an existing, too-open namespace directory is tightened
        pre = tmp_path / "b"
        probe = DiskKVStore(pre, NS)
        os.chmod(probe.directory, 0o777)
        s2 = DiskKVStore(pre, NS)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a" / "root") == 0o700
    assert _mode(s.directory) == 0o700
    assert _mode(_file(s)) == 0o600
    assert _mode(s2.directory) == 0o700


def _flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(raw)


def test_flipped_payload_byte_fails_and_deletes(store):
    data = _payload(5000)
    store.write(KEY, data)
    _flip(_file(store), HEADER.size + 1234)
    assert not store.read_into(KEY, bytearray(len(data)))
    assert not _file(store).exists()
    assert store.scan() == {}


@pytest.mark.parametrize(
    "offset",
    [0, 4, 6, 6 + 16, 6 + 32, 6 + 32 + 8],  # magic, version, namespace, key, length, checksum
    ids=["magic", "version", "namespace", "key", "length", "checksum"],
)
def test_flipped_header_byte_fails_and_deletes(store, offset):
    data = _payload(2000)
    store.write(KEY, data)
    _flip(_file(store), offset)
    assert not store.read_into(KEY, bytearray(len(data)))
    assert not _file(store).exists()


@pytest.mark.parametrize("keep", [0, 10, HEADER.size, HEADER.size + 999])
def test_truncated_file_fails_and_deletes(store, keep):
    data = _payload(2000)
    store.write(KEY, data)
    os.truncate(_file(store), keep)
    assert not store.read_into(KEY, bytearray(len(data)))
    assert not _file(store).exists()


def test_wrong_out_length_fails_but_keeps_file(store):
    data = _payload(2000)
    store.write(KEY, data)
    assert not store.read_into(KEY, bytearray(1999))
    assert not store.read_into(KEY, bytearray(2001))
    assert _file(store).exists()  # a valid file; the caller asked for the wrong size
    out = bytearray(2000)
    assert store.read_into(KEY, out) and bytes(out) == data


def test_missing_key_and_delete(store):
    assert not store.read_into(KEY, bytearray(10))
    store.delete(KEY)  # missing is fine
    store.write(KEY, b"x" * 10)
    store.delete(KEY)
    assert not _file(store).exists()
    assert not store.read_into(KEY, bytearray(10))


@pytest.mark.parametrize(
    "other", [NS.replace("model=tiny", "model=big"), NS.replace("page_size=16", "page_size=32")]
)
def test_other_namespace_does_not_see_files(tmp_path, other):
    a = DiskKVStore(tmp_path, NS)
    b = DiskKVStore(tmp_path, other)
    assert a.directory != b.directory
    a.write(KEY, _payload(100))
    assert b.scan() == {}
    assert not b.read_into(KEY, bytearray(100))
    # a file moved into the other namespace's directory fails on the namespace digest
    os.replace(_file(a), _file(b))
    assert not b.read_into(KEY, bytearray(100))
    assert not _file(b).exists()


def test_renamed_file_fails_on_key(store):
    store.write(KEY, _payload(100))
    os.replace(_file(store, KEY), _file(store, KEY2))
    assert not store.read_into(KEY2, bytearray(100))


def test_scan_after_restart_and_temp_cleanup(tmp_path):
    s = DiskKVStore(tmp_path, NS)
    s.write(KEY, _payload(100))
    s.write(KEY2, _payload(7777))
    tmp = s.directory / f".{KEY.hex()}.deadbeef.tmp"
    tmp.write_bytes(b"partial")
    (s.directory / "notakey.kv").write_bytes(b"\0" * 100)  # bad name: ignored
    (s.directory / ("ab" * 16 + ".kv")).write_bytes(b"\0" * (HEADER.size - 1))  # too small: ignored
    s2 = DiskKVStore(tmp_path, NS)
    assert s2.directory == s.directory
    assert s2.scan() == {KEY: 100, KEY2: 7777}
    assert not tmp.exists()
    out = bytearray(7777)
    assert s2.read_into(KEY2, out) and bytes(out) == _payload(7777)


def test_symlink_not_followed(store, tmp_path):
    target = tmp_path / "target"
    store.write(KEY, _payload(100))
    target.write_bytes(_file(store).read_bytes())  # a valid page file, reachable only through a link
    os.unlink(_file(store))
    os.symlink(target, _file(store))
    assert not store.read_into(KEY, bytearray(100))
    assert store.scan() == {}
    data = _payload(100, seed=5)
    store.write(KEY, data)
    assert not _file(store).is_symlink() and _file(store).is_file()
    assert target.read_bytes()[HEADER.size:] == _payload(100)  # not written through
    out = bytearray(100)
    assert store.read_into(KEY, out) and bytes(out) == data


@pytest.mark.parametrize("key", [b"", b"x" * 15, b"x" * 17, "x" * 16])
def test_bad_key_raises(store, key):
    with pytest.raises(ValueError):
        store.write(key, b"abc")
    with pytest.raises(ValueError):
        store.read_into(key, bytearray(3))
    with pytest.raises(ValueError):
        store.delete(key)


def test_root_is_file_raises(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="not a directory"):
        DiskKVStore(f, NS)


# -- what the tier opens: only regular files of its own ------------------------------------------

def _read_within(store, key, n, seconds=10.0):
    """``store.read_into`` on a thread; fails (instead of hanging the test run) if it does not return."""
    result = []
    thread = threading.Thread(target=lambda: result.append(store.read_into(key, bytearray(n))), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        path = _file(store, key)
        if stat.S_ISFIFO(os.lstat(path).st_mode):       # release a reader blocked on the FIFO
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
            os.write(fd, b"\0" * 64)
            os.close(fd)
        pytest.fail(f"read_into did not return within {seconds} s")
    return result[0]


def _plant(store, kind, tmp_path):
    """Put a ``kind`` entry where KEY's page file would be (after a valid page was written there)."""
    store.write(KEY, _payload(100))
    path = _file(store)
    valid = path.read_bytes()
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_bytes(valid)          # a valid page, only reachable through the link
        os.symlink(tmp_path / "elsewhere", path)
    elif kind == "symlink-to-fifo":
        os.mkfifo(tmp_path / "pipe", 0o600)
        os.symlink(tmp_path / "pipe", path)
    elif kind == "directory":
        os.mkdir(path, 0o700)
        (path / "inside").write_bytes(b"kept")
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(tmp_path / "s"))                       # a page path is too long for a socket address
        sock.close()
        os.rename(tmp_path / "s", path)
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))     # what /dev/null is
    elif kind == "foreign":
        path.write_bytes(valid)
        os.chown(path, 4242, -1)
    return path


KINDS = ["fifo", "symlink", "symlink-to-fifo", "directory", "socket",
         pytest.param("device", marks=pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")),
         pytest.param("foreign", marks=pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root"))]


@pytest.mark.parametrize("kind", KINDS)
def test_non_regular_entry_is_a_miss(store, tmp_path, kind, caplog):
    """Anything but a regular file of ours where a page file should be is a miss, at once (a FIFO
    without a writer never blocks the reader), counted and logged; it is removed unless it is a
    directory, and the key can be written and read again."""
    path = _plant(store, kind, tmp_path)
    with caplog.at_level(logging.WARNING, logger="radixrelay.radix.disk_store"):
        assert _read_within(store, KEY, 100) is False
        assert _read_within(store, KEY, 100) is False
    assert store.refused == (2 if kind == "directory" else 1)      # the others are gone after the first
    assert sum("in place of a page file" in r.getMessage() for r in caplog.records) == 1     # logged once
    assert store.scan() == {}
    if kind == "directory":
        assert (path / "inside").read_bytes() == b"kept"      # a directory is never removed
        with pytest.raises(OSError):
            store.write(KEY, _payload(100))
        return
    assert not os.path.lexists(path)
    data = _payload(100, seed=7)
    store.write(KEY, data)
    out = bytearray(100)
    assert _read_within(store, KEY, 100) and store.read_into(KEY, out) and bytes(out) == data
    if kind == "symlink":
        assert (tmp_path / "elsewhere").exists()              # the link was removed, not its target


def test_fifo_among_pages_leaves_other_pages_readable(store):
    """A FIFO planted for one key does not affect reads of the others."""
    store.write(KEY2, _payload(300, seed=3))
    store.write(KEY, _payload(100))
    os.unlink(_file(store, KEY))
    os.mkfifo(_file(store, KEY), 0o600)
    for _ in range(3):
        assert _read_within(store, KEY, 100) is False
        out = bytearray(300)
        assert store.read_into(KEY2, out) and bytes(out) == _payload(300, seed=3)


# -- the directory the tier is given -------------------------------------------------------------

@pytest.mark.parametrize("mode, writable_by", [(0o777, "group and others"), (0o770, "group"), (0o703, "others")])
def test_open_existing_directory_is_refused(tmp_path, mode, writable_by):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, mode)
    for build in (lambda: DiskKVStore(root, NS), lambda: EngineConfig(disk_kv_path=str(root))):
        with pytest.raises(ValueError) as err:
            build()
        msg = str(err.value)
        assert str(root) in msg and f"writable by {writable_by}" in msg and f"chmod 700 {root}" in msg, msg
    assert "EngineConfig.disk_kv_path" in str(pytest.raises(ValueError, EngineConfig, disk_kv_path=str(root)).value)
    assert _mode(root) == mode and list(root.iterdir()) == []       # left as it was, nothing created


def test_symlinked_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    os.symlink(real, link)
    for build in (lambda: DiskKVStore(link, NS), lambda: EngineConfig(disk_kv_path=str(link))):
        with pytest.raises(ValueError, match="symbolic link") as err:
            build()
        assert str(link) in str(err.value)
    assert list(real.iterdir()) == []
    DiskKVStore(real, NS)                                       # the real directory itself is fine


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_directory_of_another_user_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 4242, -1)
    for build in (lambda: DiskKVStore(root, NS), lambda: EngineConfig(disk_kv_path=str(root))):
        with pytest.raises(ValueError, match="owned by uid 4242") as err:
            build()
        assert f"chown {os.geteuid()} {root}" in str(err.value)


def test_private_existing_directory_is_used_as_is(tmp_path):
    """A directory of ours that only we can write is accepted, and its mode is not changed (0o755:
    readable by others, the namespace directory below it is 0o700)."""
    root = tmp_path / "mine"
    root.mkdir()
    os.chmod(root, 0o755)
    EngineConfig(disk_kv_path=str(root))
    s = DiskKVStore(root, NS)
    assert _mode(root) == 0o755 and _mode(s.directory) == 0o700
    EngineConfig(disk_kv_path=str(tmp_path / "missing"))      # created later, 0o700
