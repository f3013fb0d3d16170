"""Tensor parallelism inside the model (Megatron-style), for ``size`` ranks of one process group.

Each rank holds a slice of every large matrix and the model's output is the same on every rank:

- q/k/v (fused ``qkv_proj``): column-parallel by heads. Rank r holds query heads
  ``[r * Hq/tp, (r + 1) * Hq/tp)`` and the key/value heads those queries read: ``Hkv/tp`` of them when
  ``tp`` divides ``Hkv``, else one (``tp`` a multiple of ``Hkv``: a KV head replicated on
  ``tp/Hkv`` ranks). The KV cache of a rank holds its KV heads only.
- o_proj and down_proj: row-parallel (input features split); each rank's partial product is summed
  by an all-reduce.
- gate/up (fused ``gate_up_proj``): column-parallel, each half split alike.
- Routed experts (``radixrelay.model.moe``): every rank holds every expert, each expert's width split as
  the dense MLP's is (gate/up column-parallel, down row-parallel); the router is replicated, so every rank
  picks the same experts for a token, and the weighted sum of a rank's expert outputs is its share of the
  layer's output: one all-reduce after down, as for the dense MLP. (Expert parallelism, whole experts per
  rank, would trade that for an all-to-all of the tokens and an uneven load per rank.)
- The embedding and the LM head: vocab-parallel, ``ceil(V/tp)`` rows per rank (the last rank's
  padded with zeros). A lookup masks tokens outside the rank's rows and all-reduces; logits are
  gathered across ranks and cut back to V columns.
- Norms and RoPE: replicated.

``TensorParallel()`` (size 1) makes every collective a no-op and every slice the whole tensor.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from radixrelay.model.model_config import ModelConfig


class AllReduceClock:
    """Seconds one rank spends in all-reduces, and how many it ran.

    On the CPU each call is timed as it runs (``timed``: gloo returns when the sum is done). On CUDA
    the calls run inside CUDA graphs, where the host cannot time them: the worker measures the
    device time of one all-reduce per row count at start-up (``calibrated``, from graph replays) and
    each forward adds its calls at that time, interpolated linearly in rows (``forward``)."""

    def __init__(self, timed: bool = False) -> None:
        self.timed = timed
        self.seconds = 0.0
        self.calls = 0
        self._rows: list[int] = []          # ascending row counts measured at start-up
        self._seconds: list[float] = []     # device seconds of one all-reduce of that many rows

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1

    def calibrated(self, rows: list[int], seconds: list[float]) -> None:
        if not rows or len(rows) != len(seconds) or rows != sorted(set(rows)):
            raise ValueError(f"AllReduceClock: ascending distinct row counts with one time each expected, got "
                             f"{rows!r} / {seconds!r}")
        self._rows, self._seconds = list(rows), list(seconds)

    def cost(self, rows: int) -> float:
        """Device seconds of one all-reduce of ``rows`` rows (0 before calibration)."""
        r, s = self._rows, self._seconds
        if not r:
            return 0.0
        i = bisect.bisect_left(r, rows)
        if i == 0:
            return s[0]
        if i == len(r):                                 # beyond the largest measured: proportional to rows
            return s[-1] * rows / r[-1]
        lo, hi = r[i - 1], r[i]
        return s[i - 1] + (s[i] - s[i - 1]) * (rows - lo) / (hi - lo)

    def forward(self, rows: int, calls: int) -> None:
        """A forward of ``rows`` token rows ran ``calls`` all-reduces inside graphs (calibrated clocks only)."""
        if self._rows:
            self.seconds += calls * self.cost(rows)
            self.calls += calls


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None            # torch.distributed ProcessGroup; None: the default group
    fast: SymmetricAllReduce | None = None     # small all-reduces on CUDA (else the group's backend)
    clock: AllReduceClock = field(default_factory=AllReduceClock, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor parallel size must be an integer >= 1, got {self.size!r}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} outside [0, {self.size})")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place."""
        if not self.enabled:
            return x
        if self.fast is not None and self.fast.fits(x):
            return self.fast(x)
        import torch.distributed as dist

        if not self.clock.timed:
            dist.all_reduce(x, group=self.group)
            return x
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.clock.add(time.perf_counter() - start)
        return x

    def all_reduce_add(self, x: torch.Tensor, residual: torch.Tensor, norm: Any = None):
        """The decoder's row-parallel output joined to its residual stream: s = (x summed over the ranks)
        + residual, and with ``norm`` (an ``RMSNorm``: ``weight``, ``eps``, ``norm(x, residual)``) the pair
        (norm(s), s). One kernel where the fast all-reduce takes the message (``PeerAllReduce.add``: the
        sum, the add and the norm fused, same roundings), else the all-reduce, then the add and norm as
        the layer ran them. Size 1: just the add (and norm). ``x`` may be overwritten."""
        if self.enabled and self.fast is not None:
            fused = getattr(self.fast, "add", None)
            out = None if fused is None else fused(x, residual, None if norm is None else (norm.weight, norm.eps))
            if out is not None:
                return out
        x = self.all_reduce(x)
        return residual + x if norm is None else norm(x, residual)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., n] on every rank -> [..., size * n], rank r's columns at ``[r * n, (r + 1) * n)``."""
        if not self.enabled:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    # -- what a rank holds ---------------------------------------------------------------------

    def check(self, config: ModelConfig) -> None:
        """Raise ``ValueError`` unless ``config`` splits over ``size`` ranks (the rule:
        ``ModelConfig.tensor_parallel_problem``; the launcher checks it before any process starts)."""
        problem = config.tensor_parallel_problem(self.size)
        if problem:
            raise ValueError(problem)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes one rank computes: its query and KV heads, its MLP width and each expert's (vocab unchanged)."""
        self.check(config)
        return dataclasses.replace(config, num_heads=config.num_heads // self.size,
                                   num_kv_heads=self.kv_heads(config)[1],
                                   intermediate_size=config.intermediate_size // self.size,
                                   moe_intermediate_size=config.moe_intermediate_size // self.size)

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        """(first KV head, KV heads) of this rank."""
        if config.num_kv_heads >= self.size:
            count = config.num_kv_heads // self.size
            return self.rank * count, count
        return self.rank * config.num_kv_heads // self.size, 1

    def vocab_rows(self, vocab_size: int) -> tuple[int, int, int]:
        """(first row, rows held with padding, rows that are real tokens) of this rank's slice of the
        embedding and the LM head."""
        per_rank = -(-vocab_size // self.size)
        start = self.rank * per_rank
        return start, per_rank, max(0, min(per_rank, vocab_size - start))

    def weight_slice(self, hf_name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (HF name, full shape)."""
        if not self.enabled:
            return tensor
        leaf = hf_name.split(".")[-2] if "." in hf_name else hf_name
        d = config.head_dim
        if leaf == "q_proj":
            heads = config.num_heads // self.size
            return _narrow(hf_name, tensor, 0, config.q_size, self.rank * heads * d, heads * d)
        if leaf in ("k_proj", "v_proj"):
            first, count = self.kv_heads(config)
            return _narrow(hf_name, tensor, 0, config.kv_size, first * d, count * d)
        # an expert's projections (``mlp.experts.<e>.<proj>``) split along its own width
        inter = config.moe_intermediate_size if ".experts." in hf_name else config.intermediate_size
        if leaf in ("gate_proj", "up_proj"):
            width = inter // self.size
            return _narrow(hf_name, tensor, 0, inter, self.rank * width, width)
        if leaf == "o_proj":
            if hf_name.endswith(".bias"):
                raise ValueError(f"{hf_name}: an o_proj bias is not supported with tensor parallelism")
            heads = config.num_heads // self.size
            return _narrow(hf_name, tensor, 1, config.q_size, self.rank * heads * d, heads * d)
        if leaf == "down_proj":
            width = inter // self.size
            return _narrow(hf_name, tensor, 1, inter, self.rank * width, width)
        if leaf in ("embed_tokens", "lm_head"):
            start, rows, real = self.vocab_rows(config.vocab_size)
            part = _narrow(hf_name, tensor, 0, config.vocab_size, start, real)
            if real == rows:
                return part
            padded = tensor.new_zeros((rows, *tensor.shape[1:]))
            padded[:real] = part
            return padded
        return tensor                                   # norms, rope_freqs, the experts' router: replicated


def _narrow(name: str, tensor: torch.Tensor, dim: int, full: int, start: int, size: int) -> torch.Tensor:
    if tensor.dim() <= dim or tensor.shape[dim] != full:
        raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {full} along "
                         f"dimension {dim}")
    return tensor.narrow(dim, start, size)


def _enable_symmetric_memory(symm_mem: Any, group_name: str) -> None:
    """Older torch needs the group enabled for symmetric memory; newer torch only warns that it need not be."""
    import warnings

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)


def _or_none(cls: type, group: Any, device: torch.device, dtype: torch.dtype, max_bytes: int):
    """``cls(...)``, or None (logged) where it cannot be built here: the caller keeps NCCL."""
    import logging

    try:
        return cls(group, device, dtype, max_bytes)
    except Exception as exc:  # noqa: BLE001 - any failure here means: use NCCL
        logging.getLogger("radixrelay.worker").warning(
            "%s unavailable (%s: %s); all-reduces use NCCL", cls.__name__, type(exc).__name__, exc)
        return None


class SymmetricAllReduce:
    """A one-shot all-reduce for small messages on the GPUs of one host: every rank copies its tensor
    into a buffer of symmetric memory (``torch.distributed._symmetric_memory``: mapped on every rank of
    the group) and each rank sums all ranks' buffers itself, in rank order, so the result is the same
    on every rank. For decode-sized messages it is a few times faster than NCCL's ring, whose latency
    dominates small messages. No NVLink multicast. Capturable in CUDA graphs. Messages larger than
    the buffer, or of another dtype, go to NCCL."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = (group or dist.group.WORLD).group_name
        _enable_symmetric_memory(symm_mem, self.group_name)
        self.dtype = dtype
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        if handle is None:
            raise RuntimeError("symmetric memory rendezvous failed")
        handle.barrier()
        self._op = getattr(torch.ops.symm_mem, "one_shot_all_reduce_out", None)

    @classmethod
    def create(cls, group: Any, device: torch.device, dtype: torch.dtype, max_bytes: int):
        """None where symmetric memory is not available (the caller keeps NCCL), with the reason logged."""
        return _or_none(cls, group, device, dtype, max_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.buffer.numel() and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: a contiguous tensor of ``dtype`` -> x summed over the ranks, in place."""
        n = x.numel()
        staged = self.buffer[:n]
        staged.copy_(x.view(-1))
        if self._op is not None:
            self._op(staged, "sum", self.group_name, out=x.view(-1))
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            x.view(-1).copy_(staged)
        return x


class PeerAllReduce:
    """Our all-reduce kernels (``radixrelay.kernels.all_reduce``) over symmetric memory, one launch per call:
    one-shot (each rank sums the whole message from every rank's buffer) for small messages and two
    ranks, two-shot (each rank sums its segment, then reads the others' sums: half the bytes over the
    links at four ranks) for messages of ``two_shot_bytes`` or more at more ranks. The grid is at most
    one program per SM, so every program is resident. Same contract as ``SymmetricAllReduce``: the
    result is bitwise the same on every rank; capturable in CUDA graphs; no NVLink multicast."""

    TWO_SHOT_BYTES = 256 << 10

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        from radixrelay.kernels.all_reduce import flag_count

        self.group_name = (group or dist.group.WORLD).group_name
        _enable_symmetric_memory(symm_mem, self.group_name)
        self.dtype = dtype
        self.max_programs = torch.cuda.get_device_properties(device).multi_processor_count
        self.capacity = max_bytes // dtype.itemsize            # elements of the largest message
        world = dist.get_world_size(group)
        # a slot per rank (the push layout: rank p's message in slot p of every buffer); pull uses slot 0
        self.buffer = symm_mem.empty(world * self.capacity, dtype=dtype, device=device)
        buffers = symm_mem.rendezvous(self.buffer, self.group_name)
        if buffers is None:
            raise RuntimeError("symmetric memory rendezvous failed")
        self.world, self.rank = buffers.world_size, buffers.rank
        if self.world & (self.world - 1):
            raise RuntimeError(f"{self.world} ranks: the peer kernels need a power of two")
        self.flags = symm_mem.empty(flag_count(self.world, self.max_programs), dtype=torch.int32, device=device)
        self.flags.zero_()
        flags = symm_mem.rendezvous(self.flags, self.group_name)
        if flags is None:
            raise RuntimeError("symmetric memory rendezvous failed")
        self.epochs = torch.zeros(self.max_programs, dtype=torch.int32, device=device)
        self.buffer_ptrs = torch.tensor(buffers.buffer_ptrs, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(flags.buffer_ptrs, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        flags.barrier()                                # every rank's flags are zero before the first call
        self.two_shot_bytes = self.TWO_SHOT_BYTES if self.world > 2 else max_bytes + 1

    @classmethod
    def create(cls, group: Any, device: torch.device, dtype: torch.dtype, max_bytes: int):
        """None where symmetric memory is not available (the caller keeps NCCL), with the reason logged."""
        return _or_none(cls, group, device, dtype, max_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        from radixrelay.kernels.all_reduce import VEC

        return (x.dtype == self.dtype and x.numel() <= self.capacity and x.numel() % VEC == 0
                and x.is_contiguous())

    PUSH = True            # one-shot: ranks push their message into every buffer (else each pulls the others')

    def __call__(self, x: torch.Tensor, two_shot: bool | None = None, block: int | None = None,
                 push: bool | None = None) -> torch.Tensor:
        """x: a contiguous tensor of ``dtype`` -> x summed over the ranks, in place (``two_shot`` None: by size;
        ``block``: elements per program and iteration, None for the kernel's default; ``push`` None: ``PUSH``)."""
        from radixrelay.kernels.all_reduce import BLOCK, peer_all_reduce

        if two_shot is None:
            two_shot = x.numel() * x.element_size() >= self.two_shot_bytes
        return peer_all_reduce(x, self.buffer_ptrs, self.flag_ptrs, self.epochs, self.rank, self.world,
                               self.max_programs, two_shot=two_shot, block=block or BLOCK,
                               push=self.PUSH if push is None else push)

    def add(self, x: torch.Tensor, residual: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
            push: bool | None = None):
        """``TensorParallel.all_reduce_add`` in one launch (``peer_all_reduce_add``), or None where that
        kernel does not take the message (two-shot sizes, another dtype or layout): the caller runs the
        steps apart."""
        from radixrelay.kernels.all_reduce import MAX_HIDDEN, peer_all_reduce_add

        if (x.dim() != 2 or not self.fits(x) or x.numel() * x.element_size() >= self.two_shot_bytes
                or x.shape[1] > MAX_HIDDEN or residual.shape != x.shape or residual.dtype != x.dtype
                or not residual.is_contiguous() or (norm is not None and norm[0].dtype != x.dtype)):
            return None
        return peer_all_reduce_add(x, residual, self.buffer_ptrs, self.flag_ptrs, self.epochs, self.rank,
                                   self.world, self.max_programs, norm=norm, push=self.PUSH if push is None else push)


FAST_ALL_REDUCES = {"peer": PeerAllReduce, "symm": SymmetricAllReduce}
