"""A real server for the hostile-input tests (``test_fuzz.py``, ``test_hostile_input.py``), started
once per session on the embedded default model.

Its chat template is the model's ChatML layout plus a hostile branch: a message whose content is
``OPEN_SESAME`` makes the template reach for Python internals (the sandbox must refuse it per
request); anything else renders normally, so the template passes the start-up probe. Like Qwen3's,
it thinks: ``chat_template_kwargs: {"enable_thinking": true}`` opens a ``<think>`` block at the start
of the answer, ``false`` writes an empty one (the server reads reasoning apart: ``test_tools_http.py``).
"""

from __future__ import annotations

import pytest

from tests.runtime.server_process import ServerProcess

MODEL = "relay"
MAX_N = 4
OPEN_SESAME = "open sesame"
HOSTILE_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] == '" + OPEN_SESAME + "' %}"
    "{{ cycler.__init__.__globals__.os.popen('touch /tmp/radixrelay-template-escaped').read() }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% elif enable_thinking %}<think>\n{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="session")
def hostile_server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("hostile"), "--kv-cache-tokens", "4096",
                        "--max-n", str(MAX_N), "--served-model-name", MODEL,
                        "--chat-template", HOSTILE_TEMPLATE)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()
