"""The disk KV tier behind a real ``radixrelay serve`` (CPU; the tiny dummy model of
``tests/runtime/server_process.py``: pages are pages whatever the model says): entries that are not the
server's own page files (a FIFO, a symlink, a directory) in place of page files are misses, and every
request is still served; an unsafe ``--disk-kv-path`` stops ``serve`` at once with a message saying
how to fix it.

Six prompts (~75 tokens each) on a device pool of 40 pages of 16 tokens and a host tier of 29 pages: a
~440-token unrelated prompt pushes them out of the device and host tiers, so asking them again reads
their pages back from disk.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.runtime.server_process import ServerProcess

pytestmark = pytest.mark.timeout(600)
WORDS = ("river stone lantern orchard copper meadow falcon harbor violet thunder maple glacier canyon "
         "ember willow quartz saddle beacon cedar marble pepper lagoon summit timber velvet comet prairie").split()
PROMPTS = [f"Session {i} log: " + " ".join(random.Random(i).choice(WORDS) for _ in range(60)) + "."
           for i in range(6)]
DISTRACTOR = " ".join(f"note{i} alpha beta" for i in range(90))
REQUEST_TIMEOUT = 120.0
# the tiny model's page: 2 layers x K/V x 16 tokens x 2 KV heads x 16 dims x 4 bytes
PAGE_BYTES = 2 * 2 * 16 * 2 * 16 * 4
HOST_PAGES = 29


def _complete(base_url: str, prompt: str) -> str:
    r = httpx.post(f"{base_url}/v1/completions", timeout=REQUEST_TIMEOUT,
                   json={"model": "default", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return float(next(line for line in text.splitlines() if line.startswith(name)).split()[-1])


def _page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kv") if p.is_file() and not p.is_symlink())


@pytest.fixture(scope="module")
def disk_server(tmp_path_factory, tiny_model):
    disk = tmp_path_factory.mktemp("kv-disk")
    srv = ServerProcess(tmp_path_factory.mktemp("disk-srv"), *tiny_model, "--kv-cache-tokens", str(16 * 40),
                        "--host-kv-gib", str(HOST_PAGES * PAGE_BYTES / (1 << 30)), "--disk-kv-path", str(disk))
    try:
        yield srv.wait_ready(), disk
    finally:
        srv.stop()


def test_non_regular_page_files_are_misses_and_requests_are_served(disk_server, tmp_path):
    srv, disk = disk_server
    first = [_complete(srv.base_url, p) for p in PROMPTS]
    _complete(srv.base_url, DISTRACTOR)
    deadline = time.monotonic() + 60                    # disk writes are acknowledged asynchronously
    while len(_page_files(disk)) < 2 * len(PROMPTS) and time.monotonic() < deadline:
        time.sleep(0.2)
    files = _page_files(disk)
    assert len(files) >= 2 * len(PROMPTS), files
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for i, path in enumerate(files):                    # every page file replaced by something else
        kind = ("fifo", "symlink", "directory")[i % 3]
        target = elsewhere / path.name
        os.replace(path, target)
        if kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "symlink":
            os.symlink(target, path)                     # a valid page, only reachable through the link
        else:
            os.mkdir(path, 0o700)
    failed_before = _metric(srv.base_url, "radixrelay_kv_tier_read_failed_pages")
    again = [_complete(srv.base_url, p) for p in PROMPTS]
    assert again == first                               # recomputed where the pages were refused
    assert _metric(srv.base_url, "radixrelay_kv_tier_read_failed_pages") > failed_before
    assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200
    assert _complete(srv.base_url, "The capital of France is")
    assert srv.proc.poll() is None


def _serve_refused(disk_kv_path: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixrelay.cli", "serve", "--port", "0",
                           "--disk-kv-path", str(disk_kv_path)],
                          env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=120)


def test_world_writable_disk_kv_path_stops_serve_with_a_fix(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    run = _serve_refused(shared, tmp_path)
    assert run.returncode == 2, run.stderr
    assert f"chmod 700 {shared}" in run.stderr and "writable by group and others" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert list(shared.iterdir()) == []


def test_symlinked_disk_kv_path_stops_serve(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    os.symlink(real, link)
    run = _serve_refused(link, tmp_path)
    assert run.returncode == 2, run.stderr
    assert str(link) in run.stderr and "symbolic link" in run.stderr and "Traceback" not in run.stderr
    assert list(real.iterdir()) == []
