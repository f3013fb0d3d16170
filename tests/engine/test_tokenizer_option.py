"""``tokenizer=`` / ``--tokenizer``: a model directory holding only config.json, dummy weights,
and the default model's tokenizer; a tokenizer larger than the model's vocabulary is refused."""

from __future__ import annotations

import json

import pytest

from radixrelay import Engine, SamplingParams
from radixrelay.cli import _engine_config, _parser
from radixrelay.config import EngineConfig
from radixrelay.model.model_registry import resolve_model_path, tokenizer_path

DEFAULT_VOCAB = 49152          # SmolLM2's tokenizer


def _config_only_dir(path, vocab_size: int):
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False}))
    return path


def test_tokenizer_path_defaults_to_the_model(tmp_path):
    default = resolve_model_path("default")
    assert tokenizer_path(EngineConfig()) == default
    assert tokenizer_path(EngineConfig(model=str(tmp_path), tokenizer="default")) == default
    assert tokenizer_path(EngineConfig(model="default", tokenizer=str(tmp_path))) == tmp_path
    with pytest.raises(ValueError, match="tokenizer"):
        EngineConfig(tokenizer="")


def test_cli_options(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--tokenizer" in help_text and "--disable-overlap" in help_text
    args = _parser().parse_args(["serve", "--tokenizer", "default", "--disable-overlap"])
    cfg = _engine_config(args)
    assert cfg.tokenizer == "default" and cfg.disable_overlap
    cfg = _engine_config(_parser().parse_args(["generate"]))
    assert cfg.tokenizer is None and not cfg.disable_overlap


def test_dummy_config_only_model_with_the_default_tokenizer(tmp_path):
    model = _config_only_dir(tmp_path, DEFAULT_VOCAB)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with Engine(model=str(model), load_format="dummy", tokenizer="default", device="cpu",
                kv_cache_tokens=2048) as engine:
        assert engine.vocab_size == DEFAULT_VOCAB
        outs = engine.generate(["The capital of France is", "1, 2, 3,"], params)
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert all(o.error is None and isinstance(o.text, str) for o in outs)


def test_tokenizer_larger_than_the_model_vocab_is_refused(tmp_path):
    model = _config_only_dir(tmp_path, 256)
    with pytest.raises(ValueError, match=f"{DEFAULT_VOCAB} tokens .* vocabulary of 256"):
        Engine(model=str(model), load_format="dummy", tokenizer="default", device="cpu",
               kv_cache_tokens=2048)
