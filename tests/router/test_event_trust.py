"""The router's trust over its store, through real redis-servers: without a key only given (or
pattern-matched) replicas' entries are applied; with a key only signed ones, and no entry can be forged,
altered or replayed (the same entry again, an old ``removed`` to starve a replica, an old instance's
``hello`` over a newer instance); the store's password comes from a file; ``rediss://`` over TLS."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from radixrelay.kv_auth import SIG, read_key, sign
from radixrelay.kv_events import KVEventPublisher
from radixrelay.kv_store import STREAM, check_store_url, connect, read_password
from radixrelay.radix.page_keys import chain_seed, extend_keys
from radixrelay.router.kv_index import KVEventIndex
from radixrelay.router.trust import Trust, compile_pattern, make_trust
from tests.router.kv_entries import NS, PS, append, entry, hello, read_all
from tests.router.redis_server import RedisServer, redis_store  # noqa: F401 - a fixture

A, B = "http://a.test:1", "http://b.test:1"
KEY = b"0123456789abcdef0123456789abcdef"
TOKENS = list(range(300, 324))


def _keys(n: int) -> list[bytes]:
    return extend_keys([], chain_seed(NS, None), TOKENS, PS, n)


@pytest.fixture(scope="module")
def client(redis_store):
    import redis

    c = redis.Redis.from_url(redis_store.url)
    yield c
    c.close()


@pytest.fixture
def store(redis_store, client):
    client.delete(STREAM)
    return redis_store


def test_without_a_key_only_given_or_matching_names_are_believed(store, client):
    """Today any ``hello`` joined the pool: an intruder's address got users' prompts."""
    trust = Trust(given=frozenset({A}), pattern=re.compile(r"http://ok[0-9]\.test:1"))
    index = KVEventIndex(store.url, trust=trust)
    try:
        append(client, hello(A), hello(B), hello("http://ok1.test:1"), hello("http://ok1.test.evil.test:1"),
               entry("stored", B, seq=2, keys=b"".join(_keys(2))))
        read_all(index)
        assert index.replica_names() == ["http://ok1.test:1"]      # A is given: in the pool anyway
        assert B not in index.replicas and index.rejected["unknown_replica"] == 3
        # nothing given, no pattern, no key: nobody
        nobody = KVEventIndex(store.url)
        try:
            read_all(nobody)
            assert nobody.replicas == {} and nobody.replica_names() == []
        finally:
            nobody.close()
    finally:
        index.close()


def test_with_a_key_only_signed_entries_count_and_none_can_be_forged_or_replayed(store, client):
    index = KVEventIndex(store.url, trust=Trust(given=frozenset({A}), key=KEY))
    pub = KVEventPublisher(store.url, B, NS, PS, key=KEY)             # B: announced, signed
    try:
        pub.stored(_keys(4))
        pub.load(1, 0, 0.25)
        pub.close()
        read_all(index)
        assert index.replica_names() == [B] and index.matched_tokens(B, TOKENS, None) == 16
        stream = client.xrange(STREAM)
        assert all(fields[b"v"] == b"1" and SIG in fields for _, fields in stream)
        assert [int(fields[b"seq"]) for _, fields in stream] == [1, 2, 3]
        stored = next(fields for _, fields in stream if fields[b"kind"] == b"stored")
        # forged: unsigned, signed with another key, altered after signing (an unknown field added too)
        append(client, hello("http://intruder.test:1"), hello(A, key=b"another key, 16+ bytes"),
               stored | {b"seq": b"99"}, stored | {b"extra": b"1"}, entry("stored", A, seq=1, key=KEY)
               | {b"keys": b"".join(_keys(1))})
        # replayed: the same signed entry again; an old `removed` to starve B
        removed = entry("removed", B, instance=pub.instance, seq=3, key=KEY, keys=b"".join(_keys(4)))
        append(client, stored, removed)
        read_all(index)
        assert index.rejected["signature"] == 5
        assert index.rejected["replay"] == 2
        assert index.matched_tokens(B, TOKENS, None) == 16 and "http://intruder.test:1" not in index.replicas
        # a restarted B (a newer instance) is not replaced by its old instance's hello, replayed
        again = KVEventPublisher(store.url, B, NS, PS, key=KEY)
        again.close()
        old_hello = next(fields for _, fields in stream if fields[b"kind"] == b"hello")
        append(client, old_hello)
        read_all(index)
        assert index.replicas[B].instance == again.instance
        assert index.rejected["stale_instance"] == 1
        assert index.matched_tokens(B, TOKENS, None) == 0                 # the new instance holds nothing yet
        # a router without the key does not apply signed entries of names it was not given either
        plain = KVEventIndex(store.url, trust=Trust(given=frozenset({A})))
        try:
            read_all(plain)
            assert B not in plain.replicas
        finally:
            plain.close()
    finally:
        pub.close()
        index.close()


def test_a_long_key_list_is_split_into_entries_the_router_accepts(store, client):
    from radixrelay.kv_schema import MAX_ENTRY_KEYS

    tokens = list(range(MAX_ENTRY_KEYS * 2 + 8))
    keys = extend_keys([], chain_seed(NS, None), tokens, 1, len(tokens))
    pub = KVEventPublisher(store.url, A, NS, 1, key=KEY)
    index = KVEventIndex(store.url, trust=Trust(given=frozenset({A}), key=KEY))
    try:
        pub.stored(keys)
        pub.close()
        read_all(index)
        assert client.xlen(STREAM) == 4 and sum(index.rejected.values()) == 0
        assert index.matched_tokens(A, tokens, None) == len(tokens)
    finally:
        index.close()


def test_signatures_cover_every_field():
    fields = entry("load", A, load=b'{"running": 1, "waiting": 0}')
    sig = sign(KEY, fields)
    assert sign(KEY, fields | {SIG: b"whatever"}) == sig
    for name in fields:
        assert sign(KEY, fields | {name: fields[name] + b"0"}) != sig, name
    assert sign(KEY, fields | {b"new": b""}) != sig


def test_store_urls_passwords_and_keys_are_checked(tmp_path):
    assert check_store_url("rediss://cache.internal:6380/0") == "rediss://cache.internal:6380/0"
    assert check_store_url("rediss://user@h:1/0?ssl_ca_certs=/etc/ca.pem")
    for bad, why in (("redis://:secret@h:1/0", "password"), ("redis://u:secret@h:1/0", "password"),
                     ("redis://h:1/0?ssl_ca_certs=/x", "unknown parameter"), ("rediss://h:1/0?db=1", "unknown"),
                     ("https://h:1/0", "redis://")):
        with pytest.raises(ValueError, match=why) as raised:
            check_store_url(bad)
        assert "secret" not in str(raised.value)
    empty, short, good = tmp_path / "empty", tmp_path / "short", tmp_path / "good"
    empty.write_text("\n")
    short.write_text("tooshort\n")
    good.write_text(KEY.decode() + "\n")
    with pytest.raises(ValueError, match="nothing on its first line"):
        read_password(str(empty), "--store-password-file")
    with pytest.raises(ValueError, match="cannot read"):
        read_password(str(tmp_path / "missing"), "--store-password-file")
    with pytest.raises(ValueError, match="at least 16"):
        read_key(str(short), "--store-key-file")
    assert read_key(str(good), "--store-key-file") == KEY
    assert make_trust((A,), None, str(good)).key == KEY and "0123" not in repr(make_trust((A,), None, str(good)))
    with pytest.raises(ValueError, match="not a regular expression"):
        compile_pattern("http://(")


def test_a_store_with_a_password_takes_it_from_a_file(tmp_path):
    server = RedisServer(tmp_path, password="s3cret-pw")
    try:
        (tmp_path / "pw").write_text("s3cret-pw\n")
        (tmp_path / "wrong").write_text("nope\n")
        with pytest.raises(ConnectionError, match="refused"):
            connect(server.url, timeout=2)
        with pytest.raises(ConnectionError, match="refused"):
            connect(server.url, timeout=2, password=read_password(str(tmp_path / "wrong"), "pw"))
        password = read_password(str(tmp_path / "pw"), "pw")
        pub = KVEventPublisher(server.url, A, NS, PS, password=password)
        index = KVEventIndex(server.url, trust=Trust(given=frozenset({A})), password=password)
        try:
            pub.stored(_keys(2))
            pub.close()
            read_all(index)
            assert index.matched_tokens(A, TOKENS, None) == 8
        finally:
            index.close()
    finally:
        server.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test's certificate")
def test_rediss_reaches_a_store_over_tls(tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"), "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = RedisServer(tmp_path, tls=(tmp_path / "cert.pem", tmp_path / "key.pem"))
    try:
        url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={tmp_path / 'cert.pem'}"
        with pytest.raises(ConnectionError, match="does not answer"):
            connect(f"redis://127.0.0.1:{server.port}/0", timeout=1)          # plain text to a TLS port
        pub = KVEventPublisher(url, A, NS, PS)
        index = KVEventIndex(url, trust=Trust(given=frozenset({A})))
        try:
            pub.stored(_keys(3))
            pub.close()
            read_all(index)
            assert index.matched_tokens(A, TOKENS, None) == 12
        finally:
            index.close()
    finally:
        server.stop()


def test_the_cli_refuses_bad_trust_flags_with_a_clear_error(capsys, tmp_path):
    from radixrelay.cli import main

    store, missing = "redis://127.0.0.1:1/0", str(tmp_path / "missing")
    precise = ["router", "--replica", "http://127.0.0.1:1", "--mode", "precise", "--store", store]
    cases = [(["router", "--mode", "precise", "--store", store], "needs at least one --replica"),
             (["router", "--replica", "http://127.0.0.1:1", "--replica-pattern", "x"], "give --store"),
             ([*precise, "--replica-pattern", "("], "not a regular expression"),
             ([*precise, "--store-key-file", missing], "--store-key-file: cannot read"),
             (["serve", "--kv-events-key-file", missing], "give --kv-events"),
             (["serve", "--kv-events", "redis://:pw@127.0.0.1:1/0"], "--kv-events-password-file"),
             (["serve", "--kv-events", store, "--kv-events-key-file", missing], "--kv-events-key-file: cannot read")]
    for argv, why in cases:
        assert main(argv) == 2, argv
        assert why in capsys.readouterr().err, argv
