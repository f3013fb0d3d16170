"""A real ``radixrelay serve`` (default model, CPU) per test module that asks for ``endpoint``."""

from __future__ import annotations

import pytest

import radixrelay.lang as rl
from tests.runtime.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = ServerProcess(tmp_path_factory.mktemp("lang"), "--kv-cache-tokens", "4096")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def endpoint(server: ServerProcess):
    backend = rl.RuntimeEndpoint(server.base_url)
    yield backend
    backend.close()
