"""Paged KV cache memory (worker side): one K and one V tensor per layer.

Layout (docs/kv_layout.md): ``k[layer], v[layer]: [num_slots, num_kv_heads, head_dim]`` with
``num_slots = num_pages * page_size``; token position ``t`` of a request lives in slot
``pages[t // page_size] * page_size + t % page_size``. Page ids are handed out by the scheduler's
allocator; this class only owns the memory.
"""

from __future__ import annotations

import torch

from radixrelay.attention.metadata import to_device


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        model_dtype: torch.dtype | None = None,
    ) -> None:
        """``dtype``: what the cache stores; ``model_dtype``: the queries' and the attention outputs' (None: the
        same; float8_e4m3fn caches of a bf16 model differ: ``--kv-cache-dtype fp8``, read at scale 1)."""
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages),
                            ("page_size", page_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"KVCache.{name}: must be >= 1, got {value}")
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_layers, 2, num_pages * page_size, num_kv_heads, head_dim)
        # One allocation [num_layers, 2 (K, V), num_slots, num_kv_heads, head_dim], so that one gather
        # along dim 2 reads a set of pages of every layer (the KV tiers' saves); k[l] = buffer[l, 0],
        # v[l] = buffer[l, 1]: contiguous views [num_slots, num_kv_heads, head_dim].
        self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.k = [self.buffer[layer, 0] for layer in range(num_layers)]
        self.v = [self.buffer[layer, 1] for layer in range(num_layers)]
        self.model_dtype = model_dtype or dtype
        self.layer_ready: list | None = None     # see wait_for_layer
        # FP8 KV emulated (``radixrelay.model.quantization``): per layer (K scale, V scale); every write
        # stores the values an e4m3 cache with those scales gives back (``kernels.fp8.fake_quantize_kv``).
        # None: stored as they are.
        self.fp8_emulation: list[tuple[float, float]] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def wait_for_layer(self, layer_id: int) -> None:
        """Before layer ``layer_id`` stores its new K/V or reads the cache: wait (on the device) for the KV
        tier loads of that layer (``layer_ready``: one CUDA event per layer, set by the worker's
        ``TierStore`` until a step with rows ran; None when nothing is loading). Before the store too: a
        page that a load still writes may be one the step was given for its new tokens (an earlier plan's
        load into a page evicted since)."""
        events = self.layer_ready
        if events is not None:
            torch.cuda.current_stream(self.device).wait_event(events[layer_id])

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K/V. slots: int64 [T]; k, v: [T, num_kv_heads, head_dim]."""
        if self.fp8_emulation is not None:
            from radixrelay.kernels.fp8 import fake_quantize_kv

            k_scale, v_scale = self.fp8_emulation[layer_id]
            k, v = fake_quantize_kv(k, k_scale), fake_quantize_kv(v, v_scale)
        write_slots(self.k[layer_id], slots, k)
        write_slots(self.v[layer_id], slots, v)

    def copy_page_prefixes(self, copies: list[tuple[int, int, int]]) -> None:
        """For each (source page, destination page, n): the first ``n`` slots of the source page copied
        into the destination's, K and V of every layer (a reused partial page: ``StepPlan.page_copies``).
        One gather and one scatter along the slot dimension for all of them, on the current stream, after
        any KV tier load still writing a layer (``layer_ready``)."""
        if not copies:
            return
        if self.layer_ready is not None:
            for layer in range(self.num_layers):
                self.wait_for_layer(layer)
        ps = self.page_size
        src = [s * ps + i for s, _, n in copies for i in range(n)]
        dst = [d * ps + i for _, d, n in copies for i in range(n)]
        index = to_device(src + dst, torch.int64, self.device)
        src_slots, dst_slots = index[:len(src)], index[len(src):]
        buffer = self.buffer.view(torch.uint8) if self.buffer.element_size() == 1 else self.buffer
        buffer.index_copy_(2, dst_slots, buffer.index_select(2, src_slots))

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache[slots] = values in the cache's dtype (a float8 cache: torch's cast, saturating at +-448, copied as
    bytes since index_copy_ has no float8 kernels). cache: [num_slots, H, D]; slots: int64 [T]; values: [T, H, D]."""
    values = values.to(cache.dtype)
    if cache.dtype.itemsize == 1:
        cache.view(torch.uint8).index_copy_(0, slots, values.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, values)

