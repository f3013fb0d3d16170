"""The Redis store KV events go through (``radixrelay.kv_events``): its URL, its password, a checked client.

A store is ``redis://HOST:PORT/DB`` or, over TLS, ``rediss://HOST:PORT/DB`` (the server's certificate
checked against the system's CAs, or ``?ssl_ca_certs=PATH``; a client certificate with
``ssl_certfile``/``ssl_keyfile``). A user name may be in the URL (Redis ACLs); a password may not: it
would be on the command line, visible to every user of the host. It is read from a file instead
(``serve --kv-events-password-file``, ``router --store-password-file``): the first line.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

STREAM = "radixrelay:kv-events"
MAX_EVENTS = 1_000_000          # the stream is trimmed to about this many entries
SCHEMES = ("redis", "rediss")
# Query parameters a rediss:// URL may carry (passed to redis-py's TLS connection as they are).
TLS_PARAMS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname", "ssl_cert_reqs")
MAX_SECRET_BYTES = 4096


def check_store_url(url: str) -> str:
    """``url`` if it is a ``redis://`` or ``rediss://`` ``HOST:PORT/DB`` address; ``ValueError`` saying
    why not."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise ValueError(f"store {url!r}: give a redis://HOST:PORT/DB URL (rediss:// over TLS), "
                         "e.g. redis://127.0.0.1:6379/0")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"store {url!r}: the port is not a number in 0-65535") from None
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"store {url!r}: the database is a number, e.g. /0")
    if parts.password is not None:
        # not echoed back: the message would carry the password into logs
        raise ValueError("store URL: a password in the URL is on the command line for every user to see; put it "
                         "in a file and pass --store-password-file (router) / --kv-events-password-file (serve)")
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        if parts.scheme != "rediss" or name not in TLS_PARAMS:
            allowed = f"rediss:// takes {', '.join(TLS_PARAMS)}" if parts.scheme == "rediss" else "redis:// takes none"
            raise ValueError(f"store {url!r}: unknown parameter {name!r} ({allowed})")
    return url


def read_secret(path: str, what: str) -> bytes:
    """The first line of the file ``path`` (without its line end), for ``what`` (a flag's name in
    messages); ``ValueError`` when it cannot be read, is empty or too large."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_SECRET_BYTES:
        raise ValueError(f"{what}: {path} is over {MAX_SECRET_BYTES} bytes: give a file holding the secret alone")
    secret = data.split(b"\n", 1)[0].rstrip(b"\r")
    if not secret.strip():
        raise ValueError(f"{what}: {path} holds nothing on its first line")
    return secret


def read_password(path: str | None, what: str) -> str | None:
    """The store's password from ``path`` (None: no password)."""
    if path is None:
        return None
    try:
        return read_secret(path, what).decode()
    except UnicodeDecodeError:
        raise ValueError(f"{what}: {path} is not UTF-8 text") from None


def connect(url: str, timeout: float = 2.0, password: str | None = None):
    """A Redis client for ``url``, checked with a PING; ``ConnectionError`` with the reason when the store
    does not answer (or refuses the password), ``ValueError`` for a bad URL or TLS parameter."""
    import redis

    try:
        client = redis.Redis.from_url(check_store_url(url), password=password, socket_timeout=timeout,
                                      socket_connect_timeout=timeout)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"store {url!r}: {exc}") from None
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        client.close()
        raise ConnectionError(f"the store {url} refused the password: {exc}") from None
    except redis.ResponseError as exc:                     # NOAUTH: it wants a password
        client.close()
        raise ConnectionError(f"the store {url} refused the connection: {exc}") from None
    except redis.RedisError as exc:
        client.close()
        raise ConnectionError(f"the store {url} does not answer: {exc}") from None
    return client
