"""FP8 through the Engine on the CPU: the emulation serves (weights and KV in FP8, quantize-then-dequantize in
float32, the last layer kept unquantized), reuses its cached prefix, and keeps the unquantized model's likeliest
tokens; without emulation the runtime refuses to start with the reason."""

from __future__ import annotations

import pytest

from radixrelay import Engine, SamplingParams

PROMPT = "The radix tree keeps the prefixes of every prompt it has seen, so that"
# The unquantized default model's first two greedy tokens after PROMPT (" it can"), as a float32 Engine gives
# them: a constant rather than a second Engine start (or a torch import and model load here) for a reference.
UNQUANTIZED_FIRST_TOKENS = [357, 416]


def test_emulated_fp8_with_the_last_layer_kept_serves_and_reuses_its_prefix():
    """One Engine for FP8 weights (every layer but the last, ``fp8_keep_layers``) and an FP8 KV cache.
    That a kept layer stays unquantized and the rest run in FP8 is checked on the model in
    tests/model/test_fp8_model.py; an index past the model is refused there too (test_kept_layers_are_checked)."""
    prompt = PROMPT
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with Engine(model="default", device="cpu", kv_cache_tokens=1024, quantization="fp8", kv_cache_dtype="fp8",
                fp8_emulation=True, fp8_keep_layers=(-1,)) as engine:
        first = engine.generate([prompt], params)[0]
        again = engine.generate([prompt + " it"], params)[0]
    assert len(first.token_ids) == len(again.token_ids) == 4
    assert again.cached_tokens >= 16                                  # the shared prefix came from the cache
    assert first.token_ids[:2] == UNQUANTIZED_FIRST_TOKENS            # FP8 keeps the likeliest tokens here


def test_fp8_without_fp8_hardware_refuses_to_start():
    with pytest.raises(Exception, match="FP8 needs a CUDA device with FP8 tensor cores"):
        with Engine(model="default", device="auto", kv_cache_tokens=1024, quantization="fp8"):
            pass
