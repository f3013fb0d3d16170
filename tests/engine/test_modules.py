"""Prompt modules through the real Engine (default model, CPU, float32).

Reference: transformers, doing by hand what a modular prompt means (Prompt Cache): each span (module,
with its parameter values; or a scaffold) prefilled alone at its schema positions into a cache of its
own, the caches concatenated in the prompt's order, then the new text at its positions attending to
all of them, greedy. Our engine must give the same tokens and the first token's logprob to float32
tolerance. Prefix-only prompts must equal plain prompts (plain prefix caching) exactly.
"""

from __future__ import annotations

import pytest
import torch

from radixrelay import Engine, SamplingParams
from radixrelay.modules import SchemaError
from radixrelay.modules.compose import ComposedPrompt
from radixrelay.protocol.step import positions_of

from .hf_reference import _hf_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
DOCS = {
    "lethe": "The river Lethe flows through the valley of sleep; whoever drinks from it forgets the past.",
    "styx": "The river Styx marks the border of the underworld, and oaths sworn on it cannot be broken.",
    "acheron": "The Acheron is the river of woe; the ferryman Charon carries the dead across its waters.",
}
SCHEMA = (
    '<schema name="rivers">'
    '<module name="intro">You answer questions about rivers of myth, briefly and accurately. </module>'
    '<union>'
    + "".join(f'<module name="{k}">{v} </module>' for k, v in DOCS.items() if k != "acheron")
    + '</union>'
    f'<module name="acheron">{DOCS["acheron"]} </module>'
    '<module name="greet">Reader: <param name="who" len="6"/>. Answer for this reader.</module>'
    '<scaffold name="both" modules="intro acheron"/>'
    '</schema>'
)


@pytest.fixture(scope="module")
def engine():
    with Engine(page_size=16, kv_cache_tokens=4096) as eng:      # (not the CPU default's 32K tokens to zero)
        eng.register_schema(SCHEMA)
        yield eng


def _prompt(*parts: str, question: str = " Question: which river makes you forget? Answer:") -> str:
    return '<prompt schema="rivers">' + "".join(parts) + question + "</prompt>"


def hf_modular_greedy(composed: ComposedPrompt, steps: int) -> tuple[list[int], float]:
    """transformers: each span's KV from its own prefill at its positions, concatenated, then the text."""
    from transformers import DynamicCache

    model = _hf_model()
    with torch.inference_mode():
        keys: list[list[torch.Tensor]] = []
        values: list[list[torch.Tensor]] = []
        for span in composed.modules:
            cache = DynamicCache()
            pos = positions_of(span.rope_runs, 0, len(span.token_ids))
            model(torch.tensor([span.token_ids]), past_key_values=cache, use_cache=True,
                  position_ids=torch.tensor([pos]))
            for i, layer in enumerate(cache.layers):
                if i == len(keys):
                    keys.append([])
                    values.append([])
                keys[i].append(layer.keys)
                values[i].append(layer.values)
        past = DynamicCache()
        for i in range(len(keys)):
            past.update(torch.cat(keys[i], dim=2), torch.cat(values[i], dim=2), i)
        kv_len = sum(len(s.token_ids) for s in composed.modules)
        ids = composed.token_ids[kv_len:]
        pos = positions_of(composed.rope_runs, kv_len, len(composed.token_ids))
        out, first_logprob = [], None
        for _ in range(steps):
            n = len(ids)
            logits = model(torch.tensor([ids]), past_key_values=past, use_cache=True,
                           position_ids=torch.tensor([pos]),
                           cache_position=torch.arange(kv_len, kv_len + n)).logits[0, -1]
            token = int(logits.argmax())
            if first_logprob is None:
                first_logprob = float(logits.float().log_softmax(-1)[token])
            out.append(token)
            ids, pos, kv_len = [token], [pos[-1] + 1], kv_len + n
    return out, first_logprob


def _check_against_hf(engine, prompt: str, cache_salt: str | None = None):
    composed = engine.schemas.compose("rivers", prompt, salt=cache_salt)
    assert composed.is_modular
    out = engine.generate(prompt, GREEDY, prompt_schema="rivers", cache_salt=cache_salt)[0]
    ref, ref_logprob = hf_modular_greedy(composed, GREEDY.max_tokens)
    assert list(out.token_ids) == ref
    assert out.logprobs[0].logprob == pytest.approx(ref_logprob, abs=2e-3)
    return out, composed


def test_prefix_only_prompt_is_a_plain_prompt(engine):
    prompt = _prompt("<intro/>")
    composed = engine.schemas.compose("rivers", prompt)
    assert not composed.is_modular                     # positions 0, 1, 2, ...: served as plain tokens
    out = engine.generate(prompt, GREEDY, prompt_schema="rivers")[0]
    plain = engine.generate([composed.token_ids], GREEDY)[0]
    assert list(out.token_ids) == list(plain.token_ids) == hf_modular_greedy(composed, GREEDY.max_tokens)[0]
    assert out.module_tokens == 0


def test_modules_out_of_order_match_the_reference_and_are_reused(engine):
    prompt = _prompt("<acheron/>", "<lethe/>")
    out, composed = _check_against_hf(engine, prompt)
    assert len(composed.modules) == 2 and out.module_tokens == len(composed.token_ids) - len(
        composed.token_ids[sum(len(s.token_ids) for s in composed.modules):])
    before = engine.computed_tokens
    again = engine.generate(prompt, GREEDY, prompt_schema="rivers")[0]
    assert list(again.token_ids) == list(out.token_ids)
    text = len(composed.token_ids) - sum(len(s.token_ids) for s in composed.modules)
    assert engine.computed_tokens - before == text + GREEDY.max_tokens - 1     # only the new text and decode


def test_union_member_and_parameter_value_match_the_reference(engine):
    _check_against_hf(engine, _prompt("<styx/>", '<greet who="Ada"/>'))
    _check_against_hf(engine, _prompt('<greet who="Bartholomew"/>', "<lethe/>"))


def test_scaffold_is_one_span_attending_across_its_modules(engine):
    prompt = _prompt("<intro/>", "<acheron/>")
    composed = engine.schemas.compose("rivers", prompt)
    assert len(composed.modules) == 1 and "both" in composed.modules[0].key
    _check_against_hf(engine, prompt)


def test_salts_isolate_module_caches(engine):
    prompt = _prompt("<acheron/>", "<styx/>")
    engine.generate(prompt, GREEDY, prompt_schema="rivers")
    composed = engine.schemas.compose("rivers", prompt, salt="tenant-b")
    before = engine.computed_tokens
    _check_against_hf(engine, prompt, cache_salt="tenant-b")
    assert engine.computed_tokens - before >= sum(s.num_real for s in composed.modules)   # spans recomputed


def test_streaming_and_errors(engine):
    text = "".join(engine.generate_stream(_prompt("<acheron/>", "<lethe/>"), GREEDY, prompt_schema="rivers"))
    assert text == engine.generate(_prompt("<acheron/>", "<lethe/>"), GREEDY, prompt_schema="rivers")[0].text
    with pytest.raises(SchemaError, match="nile"):
        engine.generate(_prompt("<nile/>"), GREEDY, prompt_schema="rivers")
    with pytest.raises(SchemaError, match="at most 6 tokens"):
        engine.generate(_prompt('<greet who="' + "very long name " * 5 + '"/>'), GREEDY, prompt_schema="rivers")
    with pytest.raises(SchemaError):
        engine.generate(_prompt("<acheron/>"), GREEDY, prompt_schema="no-such-schema")
    assert engine.stats()["num_running"] == 0 and engine.stats()["locked_tokens"] == 0
