"""A real ``redis-server`` on 127.0.0.1 for the tests (``scripts/fetch_redis.sh`` provides it: the one on
PATH, else Debian's package unpacked into the virtualenv)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runtime.server_process import free_port

ROOT = Path(__file__).resolve().parents[2]


def redis_binary() -> tuple[str, dict[str, str]]:
    """The redis-server to run and its environment; RuntimeError saying how to get one."""
    found = shutil.which("redis-server")
    if found:
        return found, dict(os.environ)
    unpacked = Path(sys.prefix) / "redis"
    binary = unpacked / "usr" / "bin" / "redis-server"
    if not binary.exists():
        raise RuntimeError(f"no redis-server: run `bash scripts/fetch_redis.sh {sys.prefix}` (or install redis-server)")
    libs = [str(p) for p in (unpacked / "usr" / "lib" / "x86_64-linux-gnu", unpacked / "usr" / "lib") if p.exists()]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    return str(binary), env


class RedisServer:
    """A redis-server on a free port of 127.0.0.1; with ``password``, it requires it; with ``tls`` (a
    certificate and its key, PEM files), it speaks TLS only (``rediss://``)."""

    def __init__(self, tmp_path: Path, password: str | None = None, tls: tuple[Path, Path] | None = None) -> None:
        binary, env = redis_binary()
        self.port = free_port()
        self.url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{self.port}/0"
        self.log = tmp_path / f"redis-{self.port}.log"
        args = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                "--logfile", str(self.log)]
        if tls:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(tls[0]),
                     "--tls-key-file", str(tls[1]), "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if password:
            args += ["--requirepass", password]
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=1, password=password,
                             **({"ssl": True, "ssl_cert_reqs": None} if tls else {}))
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start: {self.log.read_text() if self.log.exists() else ''}")
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def redis_store(tmp_path_factory):
    """A redis-server for the tests of a module (import this fixture where it is used)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()
