"""Shared builders and checks for the kernel tests (CPU interpreter and GPU)."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tolerance(dtype: torch.dtype) -> float:
    """Absolute/relative tolerance on outputs against the float64 reference of the same inputs."""
    return {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]


def make_cache(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, gen, device=DEVICE):
    """Random k_cache, v_cache [num_pages * page_size, Hkv, D]."""
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, device=device).to(dtype)
    v = torch.randn(shape, generator=gen, device=device).to(dtype)
    return k, v


def page_lists(lengths: list[int], page_size: int, num_pages: int, gen, device=DEVICE) -> list[torch.Tensor]:
    """Disjoint random page lists covering ``lengths`` tokens each (pages drawn without replacement)."""
    need = [-(-n // page_size) for n in lengths]
    assert sum(need) <= num_pages, "cache too small for the test"
    perm = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    out, at = [], 0
    for n in need:
        out.append(perm[at : at + n])
        at += n
    return out


def page_table(lists: list[torch.Tensor], device=DEVICE) -> torch.Tensor:
    """Stack page lists into [B, max_pages] int32, rows padded with page 0."""
    width = max([len(p) for p in lists] + [1])
    table = torch.zeros((len(lists), width), dtype=torch.int32, device=device)
    for b, p in enumerate(lists):
        table[b, : len(p)] = p
    return table


def poisoned(shape: tuple[int, ...], dtype, device=DEVICE):
    """An (o, lse) pair filled with NaN: any element the kernel does not write fails the comparison."""
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape[:-1], float("nan"), dtype=torch.float32, device=device))


def int32(values, device=DEVICE) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def assert_close_attention(o, lse, o_ref, lse_ref, dtype) -> None:
    """Outputs within the dtype's tolerance, -inf LSE exactly where the reference has it, no NaN."""
    tol = tolerance(dtype)
    assert not torch.isnan(o).any(), "NaN (or an unwritten element) in o"
    assert not torch.isnan(lse).any(), "NaN (or an unwritten element) in lse"
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse).cpu(), empty.cpu()), "empty rows (lse = -inf) differ"
    assert torch.all(o[empty] == 0), "empty rows must have o = 0"
    torch.testing.assert_close(lse[~empty].double(), lse_ref[~empty].double(), atol=tol, rtol=tol)
    torch.testing.assert_close(o.double(), o_ref.double(), atol=tol, rtol=tol)
    if o.numel():
        rel = (o.double() - o_ref.double()).norm() / o_ref.double().norm().clamp_min(1e-30)
        assert rel < tol, f"relative error {rel:.2e} over {tol:.0e}"
