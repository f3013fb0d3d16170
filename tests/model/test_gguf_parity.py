"""The default SmolLM2 GGUF: our weights, logits and greedy tokens against transformers' GGUF loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrelay.text.chat_template import ChatTemplate
from radixrelay.text.tokenizer import load_tokenizer
from tests.model.paged import PagedSession

pytestmark = pytest.mark.slow

GREEDY_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model(default_gguf: Path):
    """transformers' model from the GGUF, loaded once per test process (``tests.engine.hf_reference``)."""
    pytest.importorskip("transformers")
    from tests.engine.hf_reference import _hf_model

    return _hf_model()


@pytest.fixture(scope="module")
def prompts(default_gguf: Path) -> list[list[int]]:
    """Token ids of a few chat prompts, from our tokenizer and chat template (both checked against
    transformers' for this GGUF in tests/text/test_tokenizer.py and test_chat_template.py); building
    transformers' tokenizer from the GGUF cost more CPU than the comparisons here."""
    tok = load_tokenizer(default_gguf)
    template = ChatTemplate.for_tokenizer(tok)
    texts = ["What is the capital of France?",
             "Write a short poem about the sea.",
             "Explain what a hash table is, step by step."]
    return [tok.encode(template.render([{"role": "user", "content": t}], add_generation_prompt=True))
            for t in texts]


def test_config_from_gguf_metadata(ours):
    _, cfg = ours
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "llama", 30, 576, 9, 3)
    assert (cfg.head_dim, cfg.vocab_size, cfg.intermediate_size) == (64, 49152, 1536)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and cfg.rope_theta == 100000.0
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def test_dequantized_weights_equal_transformers(ours, hf_model):
    """Bit-exact: same dequantisation, and the Q/K rope permutation undone like transformers does."""
    model, cfg = ours
    hf = dict(hf_model.named_parameters())
    for i in (0, cfg.num_layers - 1):
        layer = model.model.layers[i]
        q, k, v = layer.self_attn.qkv_proj.weight.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        prefix = f"model.layers.{i}."
        assert torch.equal(q, hf[prefix + "self_attn.q_proj.weight"])
        assert torch.equal(k, hf[prefix + "self_attn.k_proj.weight"])
        assert torch.equal(v, hf[prefix + "self_attn.v_proj.weight"])
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(gate, hf[prefix + "mlp.gate_proj.weight"])
        assert torch.equal(up, hf[prefix + "mlp.up_proj.weight"])
        assert torch.equal(layer.mlp.down_proj.weight, hf[prefix + "mlp.down_proj.weight"])
    assert torch.equal(model.model.embed_tokens.weight, hf["model.embed_tokens.weight"])


def test_logits_match_transformers(ours, hf_model, prompts):
    """All prompts in one ragged batch (scrambled pages, page_size 16), every row's logits."""
    model, _ = ours
    session = PagedSession(model, num_pages=64, page_size=16, seed=1)
    for rid, p in enumerate(prompts):
        session.add(rid, p)
    logits = session.step([(rid, len(p)) for rid, p in enumerate(prompts)], all_logits=True)
    row = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0].float()
        ours_p = logits[row:row + len(p)]
        row += len(p)
        assert (ours_p - ref).abs().max().item() < 2e-3, "logits differ from transformers"
        assert torch.equal(ours_p.argmax(-1), ref.argmax(-1))


def test_greedy_tokens_match_generate(ours, hf_model, prompts):
    """Batched greedy decoding through the paged cache (page_size 4) equals HF generate."""
    model, _ = ours
    chosen = {0: prompts[1], 1: prompts[2]}
    session = PagedSession(model, num_pages=128, page_size=4, seed=2)
    got = session.greedy(chosen, GREEDY_TOKENS)
    for rid, p in chosen.items():
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    do_sample=False, max_new_tokens=GREEDY_TOKENS,
                                    eos_token_id=None, pad_token_id=0)
        expected = out[0, len(p):].tolist()
        assert len(expected) == GREEDY_TOKENS
        assert got[rid] == expected
