"""Prompt modules on a GPU: modular prompts (spans at their schema positions, RoPE deltas on the new
text and the decoded tokens) through decode CUDA graphs and piecewise graphs, against the same engine
run eagerly, in bf16. Exactness against a by-hand reference is tested on the CPU
(``tests/engine/test_modules.py``); this checks that the graphs carry the deltas.

The tiny word-level model of ``test_engine_gpu.py`` (dummy weights): no model files needed.
"""

from __future__ import annotations

import pytest

from radixrelay import Engine, SamplingParams

from .test_engine_gpu import WORDS, greedy_close, make_tiny_model_dir

pytestmark = pytest.mark.gpu
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
DOCS = {f"d{i}": " ".join(WORDS[40 * i:40 * i + 37]) for i in range(6)}     # 37 words each
SCHEMA = ('<schema name="docs"><module name="intro">' + " ".join(WORDS[300:320]) + "</module>"
          + "<union>" + "".join(f'<module name="{k}">{v}</module>' for k, v in list(DOCS.items())[:3]) + "</union>"
          + "".join(f'<module name="{k}">{v}</module>' for k, v in list(DOCS.items())[3:]) + "</schema>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-modules"))


def prompts() -> list[str]:
    """Twelve prompts importing documents in several orders (none prefix-only: every one is modular)."""
    picks = [("d3", "d0"), ("d4", "d1", "d5"), ("d5", "d3"), ("d2", "d4"), ("d1", "d5", "d3"), ("d0", "d4", "d5")]
    return ['<prompt schema="docs">' + "".join(f"<{d}/>" for d in pick) + f" {WORDS[400 + q]} {WORDS[450 + q]}</prompt>"
            for q, pick in enumerate(picks * 2)]


def run(model_dir, device: str = "cuda", **options):
    with Engine(model=str(model_dir), load_format="dummy", device=device, kv_cache_tokens=65536, **options) as eng:
        eng.register_schema(SCHEMA)
        outs = eng.generate(prompts(), PARAMS, prompt_schema="docs")
        return outs, eng.stats()


def test_modular_decode_on_graphs_matches_eager(model_dir):
    graphs, stats = run(model_dir)
    eager, eager_stats = run(model_dir, disable_cuda_graphs=True)
    assert all(o.error is None and len(o.token_ids) == 24 and o.module_tokens > 0 for o in graphs)
    assert stats["eager_steps"] == 0 and stats["graph_replays"] > 0 and stats["decode_steps_advanced"] > 0
    assert eager_stats["graph_replays"] == 0
    # bf16: graphs and eager launch the same kernels on other buffers
    assert greedy_close(eager, graphs, "graphs") >= 8 * len(eager)
