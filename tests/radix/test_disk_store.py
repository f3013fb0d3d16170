import os
import stat

import numpy as np
import pytest

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
