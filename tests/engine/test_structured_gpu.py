"""Structured outputs on CUDA (decode graphs, piecewise graphs, overlap): a small Llama with dummy
weights and the default model's tokenizer (the installed package or the carried GGUF copy). Random
weights make the unconstrained distribution near uniform, so every output leaning on the mask to stay
valid is a strong check that the mask reaches the sampler on the device."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixrelay import Engine, SamplingParams
from radixrelay.structured import StructuredOutput

pytestmark = pytest.mark.gpu
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "kind": {"enum": ["a", "b"]}, "ok": {"type": "boolean"}},
          "required": ["name", "n", "kind", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from benchmarks.common import default_tokenizer

    path = tmp_path_factory.mktemp("small-llama")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False}))
    return str(path), default_tokenizer()


def _run(model_dir, dtype: str, disable_overlap: bool = False):
    path, tokenizer = model_dir
    params = [SamplingParams(max_tokens=80, temperature=t, seed=i, structured=StructuredOutput.json_schema(SCHEMA))
              for i, t in enumerate((0.0, 1.0, 1.0, 1.0))]
    params += [SamplingParams(max_tokens=24, temperature=1.0, seed=10 + i, structured=StructuredOutput.regex(r"\d{3}-\d{4}"))
               for i in range(4)]
    params += [SamplingParams(max_tokens=8, temperature=1.0, seed=20 + i, structured=StructuredOutput.choice(["yes", "no"]))
               for i in range(4)]
    params += [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)] * 4
    prompts = [f"Question {i}: tell me something." for i in range(len(params))]
    with Engine(model=path, load_format="dummy", tokenizer=tokenizer, device="cuda", dtype=dtype,
                kv_cache_tokens=8192, disable_overlap=disable_overlap) as engine:
        outs = engine.generate(prompts, params)
        again = engine.generate(prompts, params)        # decode graphs captured by now; cached prefixes
    return params, outs, again


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_follow_their_constraints_on_cuda(model_dir, dtype):
    params, outs, again = _run(model_dir, dtype)
    for p, out in [*zip(params, outs), *zip(params, again)]:
        assert out.error is None
        spec = p.structured
        if spec is None:
            assert out.completion_tokens == p.max_tokens
        elif spec.kind == "json_schema":
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), SCHEMA)
        elif spec.kind == "regex":
            assert out.finish_reason == "stop" and re.fullmatch(r"\d{3}-\d{4}", out.text), out.text
        else:
            assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_overlap_on_and_off_agree_in_fp32(model_dir):
    _, on, _ = _run(model_dir, "float32")
    _, off, _ = _run(model_dir, "float32", disable_overlap=True)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
