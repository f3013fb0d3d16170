"""``rl.Runtime``: starts a local radixrelay server, serves programs, stops it on exit."""

from __future__ import annotations

import httpx
import pytest

import radixrelay.lang as rl

pytestmark = pytest.mark.timeout(300)


def test_runtime_starts_a_server_and_stops_it():
    @rl.function
    def chat(s):
        s += rl.user("Say yes.")
        s += rl.assistant(rl.gen("answer", max_tokens=2, temperature=0))

    with rl.Runtime("default", "--kv-cache-tokens", "2048") as runtime:
        rl.set_default_backend(runtime)
        state = chat.run()
        assert httpx.get(f"{runtime.url}/health", timeout=5).status_code == 200
    # The model's own template (loaded locally), not the plain fallback.
    assert state.text().startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n" in state.text()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{runtime.url}/health", timeout=5)


def test_runtime_start_failure_reports_the_server_log():
    with pytest.raises(RuntimeError, match="no-such-model"):
        rl.Runtime("/no-such-model")
