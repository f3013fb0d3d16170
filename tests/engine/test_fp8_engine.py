"""FP8 through the Engine on the CPU: the emulation serves (weights and KV in FP8, quantize-then-dequantize in
float32), reuses its cached prefix, and says its precision; without emulation the runtime refuses to start
with the reason."""

from __future__ import annotations

import pytest

from radixrelay import Engine, SamplingParams


def test_emulated_fp8_serves_and_reuses_its_prefix():
    prompt = "The radix tree keeps the prefixes of every prompt it has seen, so that"
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with Engine(model="default", device="cpu", kv_cache_tokens=4096, quantization="fp8", kv_cache_dtype="fp8",
                fp8_emulation=True) as engine:
        first = engine.generate([prompt], params)[0]
        again = engine.generate([prompt + " it"], params)[0]
    assert len(first.token_ids) == len(again.token_ids) == 12
    assert again.cached_tokens >= 16                                  # the shared prefix came from the cache
    with Engine(model="default", device="cpu", kv_cache_tokens=4096) as plain:
        unquantized = plain.generate([prompt], params)[0]
    assert first.token_ids[:2] == unquantized.token_ids[:2]           # FP8 keeps the likeliest tokens here


def test_fp8_without_fp8_hardware_refuses_to_start():
    with pytest.raises(Exception, match="FP8 needs a CUDA device with FP8 tensor cores"):
        with Engine(model="default", device="auto", kv_cache_tokens=1024, quantization="fp8"):
            pass


def test_fp8_with_the_last_layer_kept_serves_and_refuses_a_layer_past_the_model():
    prompt = "A shared system prompt is computed once and"
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with Engine(model="default", device="cpu", kv_cache_tokens=2048, quantization="fp8", fp8_emulation=True,
                fp8_keep_layers=(-1,)) as engine:
        out = engine.generate([prompt], params)[0]
    assert len(out.token_ids) == 8
    with pytest.raises(Exception, match="fp8_keep_layers: layer 30 is not in a model of 30 layers"):
        with Engine(model="default", device="cpu", kv_cache_tokens=1024, quantization="fp8", fp8_emulation=True,
                    fp8_keep_layers=(30,)):
            pass
