"""The ``radixrelay`` command line: help texts, the API key's sources, ``generate`` with and without the
chat template."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from radixrelay import Engine, SamplingParams
from radixrelay.cli import _api_key, _parser, generate_prompt, main
from radixrelay.config import EngineConfig
from radixrelay.model.model_registry import tokenizer_path
from radixrelay.text.chat_template import ChatTemplate
from radixrelay.text.tokenizer import load_tokenizer
from tests.runtime.server_process import TINY_ENGINE, ServerProcess


def _help(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "radixrelay.cli", *args, "--help"], capture_output=True,
                         text=True, check=True)
    return out.stdout


def test_top_level_help_is_whole_sentences():
    text = _help()
    description = text.split("\n\n")[1].replace("\n", " ")
    assert description.startswith("radixrelay: an LLM serving runtime") and description.endswith(".")
    assert "serve" in text and "generate" in text and "COMMAND --help" in text


def test_generate_help_lists_no_server_only_flags():
    flags = set(re.findall(r"--[a-z-]+", _help("generate")))
    assert not flags & {"--api-key", "--host", "--port", "--max-queued-requests", "--drain-timeout"}
    text = _help("generate")
    assert "--raw" in text and "chat template" in text
    serve = _help("serve")
    for flag in ("--api-key-file", "--max-queued-requests", "--host"):
        assert flag in serve


def _serve_args(*argv: str):
    return _parser().parse_args(["serve", *argv])


def test_api_key_sources_in_order(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nsecond line is ignored\n")
    monkeypatch.setenv("RADIXRELAY_API_KEY", "from-env")
    assert _api_key(_serve_args("--api-key", "from-flag")) == "from-flag"
    assert _api_key(_serve_args("--api-key-file", str(key_file))) == "from-file"
    assert _api_key(_serve_args()) == "from-env"
    monkeypatch.delenv("RADIXRELAY_API_KEY")
    assert _api_key(_serve_args()) is None
    with pytest.raises(SystemExit):          # argparse: the two flags exclude each other
        _serve_args("--api-key", "a", "--api-key-file", str(key_file))


def test_bad_api_key_file_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["serve", "--api-key-file", str(empty)]) == 2
    assert "holds no key" in capsys.readouterr().err


def test_server_takes_its_key_from_a_file(tmp_path, tiny_model):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    server = ServerProcess(tmp_path, *tiny_model, "--api-key-file", str(key_file), "--kv-cache-tokens", "2048")
    try:
        server.wait_ready()
        assert "s3cret" not in " ".join(server.proc.args)
        assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
        ok = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    finally:
        server.stop()


def test_generate_prompt_is_the_chat_template_unless_raw():
    tokenizer = load_tokenizer(tokenizer_path(EngineConfig()))
    rendered = ChatTemplate.for_tokenizer(tokenizer).render([{"role": "user", "content": "Hi"}])
    assert "<|im_start|>user\nHi<|im_end|>" in rendered
    assert generate_prompt(tokenizer, "Hi", raw=False) == tokenizer.encode(rendered, add_special_tokens=False)
    assert generate_prompt(tokenizer, "Hi", raw=True) == "Hi"
    assert generate_prompt(tokenizer, "Hi", raw=False, chat_template="[{{ messages[0]['content'] }}]") == \
        tokenizer.encode("[Hi]", add_special_tokens=False)


def test_generate_prints_the_answer_to_the_chat_rendered_prompt(capsys, tiny_model_dir):
    """On the tiny dummy model (``tests/runtime/server_process.py``) with the default model's tokenizer and
    chat template: the printed text is the Engine's greedy answer to the rendered prompt, whatever it says."""
    model = ["--model", str(tiny_model_dir), "--load-format", "dummy", "--tokenizer", "default"]
    assert main(["generate", *model, "--kv-cache-tokens", "2048", "--max-tokens", "8", "--prompt", "Hi"]) == 0
    printed = capsys.readouterr().out
    with Engine(model=str(tiny_model_dir), **TINY_ENGINE, kv_cache_tokens=2048) as engine:
        ids = generate_prompt(engine.tokenizer, "Hi", raw=False)
        expected = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0]
    assert printed == expected.text + "\n"


def test_fp8_keep_layers_takes_indices_and_refuses_other_text(capsys):
    from radixrelay.cli import _engine_config

    args = _parser().parse_args(["serve", "--quantization", "fp8", "--fp8-emulation", "--fp8-keep-layers", "0,-1"])
    assert _engine_config(args).fp8_keep_layers == (0, -1)
    assert _engine_config(_parser().parse_args(["serve"])).fp8_keep_layers == ()
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--fp8-keep-layers", "last"])
    assert "expected layer indices separated by commas" in capsys.readouterr().err


@pytest.mark.parametrize("env, argv, words", [
    ({"RADIXRELAY_STEP_TIMEOUT_S": "abc"}, ["serve", "--port", "0"], ["RADIXRELAY_STEP_TIMEOUT_S", "'abc'"]),
    ({"RADIXRELAY_STEP_TIMEOUT_S": "-1"}, ["generate"], ["RADIXRELAY_STEP_TIMEOUT_S", "'-1'"]),
    ({}, ["serve", "--port", "0", "--tp", "2"], ["tp=2 (--tp)", "9 query heads", "sizes that split it: 1, 3"]),
    ({}, ["serve", "--port", "0", "--disable-radix-cache", "--disk-kv-path", "/tmp/radixrelay-never-made"],
     ["disable_radix_cache", "disk_kv_path"]),
])
def test_startup_mistakes_stop_the_cli_before_anything_starts(env, argv, words):
    """Each once printed "startup complete" and then died with a child's traceback, or failed after the
    worker started: now the CLI exits 2 at once with one line naming the cause."""
    import os
    import time

    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "radixrelay.cli", *argv, "--kv-cache-tokens", "2048"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert all(w in out.stderr for w in words), out.stderr
    assert "Traceback" not in out.stderr and "startup complete" not in out.stdout + out.stderr
    assert time.monotonic() - start < 30                   # no model loaded, no process started
