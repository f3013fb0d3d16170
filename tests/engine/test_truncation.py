"""Context overflow with ``truncation`` (AttentionStore 3.4) through the real Engine (default model, CPU).

A 230-token first turn fits a 256-token context; the second turn (history + answer + a question) does
not, so 128 tokens (``0.5 x 256``) after its first page are dropped. The first page is a plain hit;
the next kept pages are the first turn's KV from host memory, loaded with their keys rotated by -128
positions; the rest is computed.

Exactness: serving the kept tokens with re-positioned KV must equal transformers (the independent
reference) doing the same by hand: its own prefill of the first turn's tokens, the KV of positions
0..15 and 144..223 kept (16..143 cropped out), the keys of 144..223 rotated by -128 with
transformers' own RoPE, then the rest of the second turn at positions 96.. attending to that cache. Greedy tokens
must match and the first token's logprob agree to float32 tolerance. A full recompute of the
truncated prompt is not the same function (the kept KV above layer 0 attended to the dropped tokens
when it was computed); the README reports how often the two agree.
"""

from __future__ import annotations

import pytest
import torch

from radixrelay import Engine, SamplingParams

from .hf_reference import _hf_model

CONTEXT, PAGE = 256, 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
HISTORY = "Session log: " + " ".join(f"entry{i} river stone lantern" for i in range(60))
QUESTION = " Now summarize the whole log in one short sentence please, with care and detail."


@pytest.fixture(scope="module")
def engine():
    with Engine(context_length=CONTEXT, truncation=0.5, host_kv_gib=0.05, kv_cache_tokens=PAGE * 40) as eng:
        yield eng


def _hf_shifted_greedy(turn2: list[int], cached: int, dropped: int, steps: int) -> tuple[list[int], float]:
    """transformers: the KV of ``turn2[:PAGE] + turn2[PAGE + dropped:cached]`` computed by a prefill
    of ``turn2[:cached]``, cropped, the second part's keys rotated by ``-dropped`` positions; the rest
    of ``turn2`` attending to it at the new positions, greedy."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = _hf_model()
    moved = cached - PAGE - dropped
    with torch.inference_mode():
        full = DynamicCache()
        model(torch.tensor([turn2[:cached]]), past_key_values=full, use_cache=True)
        past = DynamicCache()
        k0 = full.layers[0].keys
        cos, sin = model.model.rotary_emb(k0, torch.full((1, moved), -dropped))
        for i, layer in enumerate(full.layers):
            rotated, _ = apply_rotary_pos_emb(layer.keys[:, :, PAGE + dropped:], layer.keys[:, :, PAGE + dropped:],
                                              cos, sin)
            past.update(torch.cat((layer.keys[:, :, :PAGE], rotated), dim=2),
                        torch.cat((layer.values[:, :, :PAGE], layer.values[:, :, PAGE + dropped:]), dim=2), i)
        ids, pos, kv_len = turn2[cached:], cached - dropped, cached - dropped
        out, first_logprob = [], None
        for _ in range(steps):
            n = len(ids)
            logits = model(torch.tensor([ids]), past_key_values=past, use_cache=True,
                           position_ids=torch.arange(pos, pos + n)[None],
                           cache_position=torch.arange(kv_len, kv_len + n)).logits[0, -1]
            token = int(logits.argmax())
            if first_logprob is None:
                first_logprob = float(logits.float().log_softmax(-1)[token])
            out.append(token)
            ids, pos, kv_len = [token], pos + n, kv_len + n
    return out, first_logprob


def test_overflowing_turn_reuses_repositioned_kv_exactly(engine):
    tok = engine.tokenizer
    turn1 = tok.encode(HISTORY)[:230]
    first = engine.generate([turn1], GREEDY)[0]
    turn2 = turn1 + list(first.token_ids) + tok.encode(QUESTION)
    assert len(turn2) + GREEDY.max_tokens > CONTEXT          # overflows: truncated, not refused
    before = engine.stats()["tier_repositioned_tokens"]

    second = engine.generate([turn2], GREEDY)[0]

    dropped = 128
    assert second.prompt_tokens == len(turn2) - dropped
    # turn 1 left 14 whole pages (224 tokens) cached; page 0 is the kept head, pages 9..13 are the
    # kept tokens' pages 1..5
    cached = 14 * PAGE
    assert engine.stats()["tier_repositioned_tokens"] - before == cached - dropped - PAGE
    assert second.cached_tokens == cached - dropped
    want, want_logprob = _hf_shifted_greedy(turn2, cached, dropped, GREEDY.max_tokens)
    assert second.token_ids == want
    assert second.logprobs[0].logprob == pytest.approx(want_logprob, abs=2e-3)


def test_fitting_prompts_are_untouched_and_impossible_ones_refused(engine):
    ids = engine.tokenizer.encode(HISTORY)[:100]
    out = engine.generate([ids], SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.prompt_tokens == 100
    with pytest.raises(ValueError, match="context"):
        engine.generate([ids], SamplingParams(max_tokens=CONTEXT, temperature=0))
