"""Prompt logprobs from the worker: chunked prefill (several chunks per request, a cached prefix
before the request) gives what one full forward's log-softmax gives, in fp32."""

from __future__ import annotations

import pytest
import torch

from radixrelay.attention import KVCache, TorchBackend
from radixrelay.attention.metadata import BatchRequest, build_forward_batch
from radixrelay.model import load_model, resolve_model_path
from radixrelay.protocol.step import PromptLogprobsChunk
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from radixrelay.worker.model_runner import ModelRunner

PAGE = 4
TOP = 3


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # small CPU matmuls: see tests/model/conftest.py
    loaded, _ = load_model(str(resolve_model_path("default")), device="cpu", dtype=torch.float32)
    yield loaded
    torch.set_num_threads(threads)


def _kv(model, num_pages: int) -> KVCache:
    cfg = model.config
    return KVCache(num_layers=cfg.num_layers, num_pages=num_pages, page_size=PAGE,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=torch.float32, device="cpu")


def _full_forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log-softmax of every position's logits, from one forward of the whole prompt."""
    pages = list(range(-(-len(ids) // PAGE)))
    batch = build_forward_batch([BatchRequest(pages, 0, len(ids), num_logits=len(ids))], PAGE, "cpu")
    logits = model(torch.tensor(ids), batch, _kv(model, len(pages)), TorchBackend())
    return logits.float().log_softmax(dim=-1)


def _drive(sched: Scheduler, runner: ModelRunner) -> dict[int, list[PromptLogprobsChunk]]:
    chunks: dict[int, list[PromptLogprobsChunk]] = {}
    while sched.has_work():
        out = runner.step(sched.schedule())
        assert out.error is None, out.error
        for chunk in out.prompt_logprobs:
            chunks.setdefault(chunk.rid, []).append(chunk)
        sched.process_output(out)
    return chunks


def test_chunked_prompt_logprobs_equal_one_full_forward(model):
    prompts = {1: list(range(300, 331)), 2: [504, 3575, 282, 4649, 314, 253, 1345, 28, 480]}
    sched = Scheduler(SchedulerConfig(kv_cache_tokens=256, page_size=PAGE, chunked_prefill_tokens=8))
    runner = ModelRunner(model, _kv(model, sched.config.num_pages), TorchBackend())
    sched.add_request(0, prompts[1][:12], SamplingParams(max_tokens=1))
    assert _drive(sched, runner) == {} and sched.stats().cached_tokens == 12   # a prefix of prompt 1
    sched.add_request(1, prompts[1], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP))
    sched.add_request(2, prompts[2], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    chunks = _drive(sched, runner)
    assert len(chunks[1]) >= 4                                  # 30 positions, 8-token budget
    for rid, ids in prompts.items():
        firsts = [c.first_token for c in chunks[rid]]
        entries = [e for c in chunks[rid] for e in c.entries]
        assert firsts == [1 + sum(len(c.entries) for c in chunks[rid][:i]) for i in range(len(firsts))]
        assert len(entries) == len(ids) - 1                     # the cached prefix was recomputed
        ref = _full_forward_logprobs(model, ids)                # row t: prompt token t + 1
        expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), expected, rtol=1e-5, atol=1e-5)   # fp32
        top = ref[:-1].topk(TOP if rid == 1 else 0, dim=-1)
        assert [[tid for tid, _ in e.top] for e in entries] == top.indices.tolist()
        values = torch.tensor([[v for _, v in e.top] for e in entries]).reshape(top.values.shape)
        torch.testing.assert_close(values, top.values, rtol=1e-5, atol=1e-5)   # fp32
