"""The benchmarks' dummy models of other families (``benchmarks.common.FAMILY_SHAPES``): each config.json
reads as its family, with the real model's shapes, windows and experts."""

from __future__ import annotations

import pytest

from benchmarks.common import FAMILY_SHAPES, family_dir
from radixrelay.model.config_files import read_hf_config

ARCHITECTURE = {"qwen3-8b": "qwen3", "gemma3-12b": "gemma3_text", "mixtral-8x7b": "mixtral",
                "qwen3-30b-a3b": "qwen3_moe"}


@pytest.mark.parametrize("name", sorted(FAMILY_SHAPES))
def test_family_configs_read_as_their_family(tmp_path, name):
    path, desc = family_dir(tmp_path / name, name, None, 49152)
    cfg = read_hf_config(path)
    keys = FAMILY_SHAPES[name][2]
    assert cfg.architecture == ARCHITECTURE[name]
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        keys["hidden_size"], keys["num_attention_heads"], keys["num_key_value_heads"], keys["head_dim"])
    assert cfg.num_layers == FAMILY_SHAPES[name][1] and cfg.vocab_size == 49152
    assert f"{cfg.num_layers} layers" in desc
    if name == "gemma3-12b":        # five local layers of window 1024 to each global one
        assert cfg.layer_windows[:12] == ((1024,) * 5 + (0,)) * 2      # 0: a global layer
    if "num_experts_per_tok" in keys:
        assert cfg.num_experts == keys.get("num_experts", keys.get("num_local_experts"))
        assert cfg.num_experts_per_tok == keys["num_experts_per_tok"]
        assert len(cfg.moe_layers) == cfg.num_layers
