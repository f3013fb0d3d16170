"""A minimal driver for model tests: a paged KV cache with scrambled page ids and per-request
token/page bookkeeping, so tests can run extends, chunks and decodes in any mix."""

from __future__ import annotations

import dataclasses
import random

import torch

from radixrelay.attention import BatchRequest, KVCache, TorchBackend, build_forward_batch
from radixrelay.model import LlamaForCausalLM


class PagedSession:
    def __init__(self, model: LlamaForCausalLM, *, num_pages: int, page_size: int, seed: int = 0) -> None:
        cfg = model.local_config                # this rank's KV heads (tensor parallel)
        dtype = next(model.parameters()).dtype
        self.model = model
        self.page_size = page_size
        self.cache = KVCache(num_layers=cfg.num_layers, num_pages=num_pages, page_size=page_size,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype, device="cpu")
        self.backend = TorchBackend()
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)  # non-contiguous, unordered page ids
        self.tokens: dict[int, list[int]] = {}
        self.pages: dict[int, list[int]] = {}
        self.done: dict[int, int] = {}         # tokens already in the KV cache

    def add(self, rid: int, tokens: list[int]) -> None:
        self.tokens[rid], self.pages[rid], self.done[rid] = list(tokens), [], 0

    def step(self, work: list[tuple[int, int]], all_logits: bool = False) -> torch.Tensor:
        """Compute the next ``n`` known tokens of each (rid, n). Returns fp32 logits: one row per
        request (its last new token), or every new token's row with ``all_logits``."""
        requests, input_ids = [], []
        for rid, n in work:
            start = self.done[rid]
            while len(self.pages[rid]) * self.page_size < start + n:
                self.pages[rid].append(self.free.pop())
            requests.append(BatchRequest(list(self.pages[rid]), start, n))
            input_ids += self.tokens[rid][start:start + n]
            self.done[rid] = start + n
        batch = build_forward_batch(requests, self.page_size, "cpu")
        if all_logits:
            batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
        return self.model(torch.tensor(input_ids), batch, self.cache, self.backend)

    def greedy(self, prompts: dict[int, list[int]], num_tokens: int) -> dict[int, list[int]]:
        """Greedy-decode every prompt together: one batched extend, then batched decodes."""
        for rid, prompt in prompts.items():
            self.add(rid, prompt)
        out: dict[int, list[int]] = {rid: [] for rid in prompts}
        for i in range(num_tokens):
            logits = (self.step([(rid, 1) for rid in prompts]) if i
                      else self.step([(rid, len(p)) for rid, p in prompts.items()]))
            for rid, token in zip(prompts, logits.argmax(-1).tolist()):
                out[rid].append(token)
                self.tokens[rid].append(token)
        return out


def compare_logits(model, hf, vocab_size: int, page_size: int = 4) -> None:
    """Two sequences in one ragged batch through ``model``, every row's logits, against transformers'
    forward (``hf``) per sequence."""
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (37, 11)]
    session = PagedSession(model, num_pages=64, page_size=page_size, seed=3)
    for rid, s in enumerate(seqs):
        session.add(rid, s)
    logits = session.step([(rid, len(s)) for rid, s in enumerate(seqs)], all_logits=True)
    ref = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs]).float()
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
