"""radixrelay backends: ``RuntimeEndpoint`` (a running server) and ``Runtime`` (start one here).

Role markers come from the model's own chat template, rendered on the client: the server serves
no template, so ``RuntimeEndpoint`` loads the tokenizer of the served model locally when the model
name (``/v1/models``) or ``model_path`` resolves on this machine (``"default"`` always does);
otherwise it falls back to ``RoleMarkers.plain()``. ``chat_template=`` overrides both.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from radixrelay.lang.chat import RoleMarkers
from radixrelay.lang.openai_compat import OpenAICompatible
from radixrelay.model.model_registry import resolve_model_path
from radixrelay.text.chat_template import ChatTemplate
from radixrelay.text.tokenizer import load_tokenizer


class RuntimeEndpoint(OpenAICompatible):
    """A radixrelay server at ``url`` (``http://127.0.0.1:30000``, without ``/v1``)."""

    def __init__(self, url: str, api_key: str | None = None, *, model_path: str | None = None,
                 chat_template: RoleMarkers | str | None = None, timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=30)
        except httpx.HTTPError as exc:
            raise ConnectionError(f"no server answers at {url}: {exc}") from exc
        try:
            model = response.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ConnectionError(f"{url}/v1/models answered {response.status_code}: "
                                  f"{response.text[:300]}") from None
        super().__init__(f"{url.rstrip('/')}/v1", model, api_key, chat_template=chat_template,
                         timeout=timeout)
        if chat_template is None:
            self.markers = local_markers(model_path or model) or RoleMarkers.plain()


def local_markers(model: str) -> RoleMarkers | None:
    """The role markers of a model found on this machine, or None (not local, or no template)."""
    try:
        tokenizer = load_tokenizer(resolve_model_path(model))
    except (ValueError, RuntimeError, OSError):
        return None
    if tokenizer.chat_template is None:
        return None
    bos = tokenizer.bos_token
    adds_bos = bos is not None and tokenizer.encode("a") != tokenizer.encode("a", add_special_tokens=False)
    return RoleMarkers.from_template(ChatTemplate.for_tokenizer(tokenizer), bos if adds_bos else None)


class Runtime(RuntimeEndpoint):
    """Starts ``radixrelay serve`` on a free local port and stops it on ``shutdown()``, at the end
    of a ``with`` block, or when this process exits. ``server_args``: further CLI options, e.g.
    ``("--kv-cache-tokens", "8192")``."""

    def __init__(self, model: str = "default", *server_args: str, startup_timeout: float = 300.0,
                 api_key: str | None = None) -> None:
        port = _free_port()
        self.log_path = Path(tempfile.mkstemp(prefix="radixrelay-runtime-", suffix=".log")[1])
        command = [sys.executable, "-m", "radixrelay.cli", "serve", "--port", str(port),
                   "--model", model, *server_args]
        if api_key:
            command += ["--api-key", api_key]
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        atexit.register(self.shutdown)
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_ready(startup_timeout)
            super().__init__(self.url, api_key, model_path=model)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"radixrelay serve exited with {self._proc.returncode}:\n{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"radixrelay serve not ready after {timeout:.0f} s:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def shutdown(self) -> None:
        """Stop the server (SIGINT twice: no drain) and its child processes; idempotent."""
        atexit.unregister(self.shutdown)
        if hasattr(self, "_http"):
            self.close()
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self.log_path.exists():
            os.unlink(self.log_path)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
