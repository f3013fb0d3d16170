"""FP8 weights and KV cache: what runs in which precision, and the linear layer that runs in FP8.

``Precision`` says how a model runs: ``weights`` "fp8" quantizes the decoder's linear layers (q/k/v, o,
gate/up, down) to float8 e4m3 with one scale per output channel (``radixrelay.kernels.fp8``), their inputs
per token at run time; embeddings, norms, attention and the LM head stay in the model dtype, and so do the
projections of the decoder layers in ``keep_layers`` (indices, negative from the end: -1 is the last layer,
which on the default model carries a third of FP8's perplexity loss alone). ``kv``
"fp8" stores K and V in e4m3 with one scale per layer for K and one for V (1.0 unless the checkpoint
gives ``k_scale`` / ``v_scale``), the attention arithmetic in the model dtype. ``emulate`` runs either on
the CPU as quantize-then-dequantize in float32: the numbers of the FP8 path without FP8 hardware (tests,
``benchmarks/model/bench_fp8_accuracy.py``); without it, FP8 needs a CUDA device with FP8 tensor cores.

``Fp8Linear`` holds ``weight`` [out, in] (e4m3 on the GPU; on the emulation path float32 holding exactly
the e4m3 values) and ``weight_scale`` [out] float32. On the GPU its product is ``torch._scaled_mm`` of the
token-quantized input and the weight with both scale vectors (fp32 accumulation, the model dtype out);
emulated, the same quantization and the product of the e4m3 values in float32, scaled afterwards.
The input is a tensor (quantized per token here) or ``QuantizedRows`` that the kernel producing it
quantized already (``takes_quantized``: the fused RMSNorm and SiLU-and-mul, ``radixrelay.model.llama``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from radixrelay.config import KV_CACHE_DTYPES, QUANTIZATIONS, keep_layers_problem
from radixrelay.kernels.fp8 import E4M3, E4M3_MAX, QuantizedRows, over_e4m3_max, quantize_weight
from radixrelay.model.layers import fused


@dataclass(frozen=True)
class Precision:
    weights: str | None = None     # None or "fp8"
    kv: str = "auto"               # "auto" or "fp8"
    emulate: bool = False          # FP8 as quantize-dequantize in float32 (no FP8 hardware needed)
    keep_layers: tuple[int, ...] = ()   # decoder layers whose projections stay in the model dtype (-1: last)

    def __post_init__(self) -> None:
        if self.weights is not None and self.weights not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.weights!r}")
        if self.kv not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv!r}")
        why = keep_layers_problem(self.keep_layers, self.weights)
        if why:
            raise ValueError(f"fp8_keep_layers: {why}")

    def kept(self, num_layers: int) -> set[int]:
        """The decoder layers (0-based) that stay in the model dtype; ``ValueError`` for an index past the model."""
        out = set()
        for i in self.keep_layers:
            if not -num_layers <= i < num_layers:
                raise ValueError(f"fp8_keep_layers: layer {i} is not in a model of {num_layers} layers "
                                 f"({-num_layers} to {num_layers - 1})")
            out.add(i % num_layers)
        return out

    def for_layer(self, layer_id: int, num_layers: int) -> "Precision":
        """This precision for decoder layer ``layer_id``: its projections in the model dtype if it is kept."""
        if self.weights is None or layer_id not in self.kept(num_layers):
            return self
        return dataclasses.replace(self, weights=None, keep_layers=())

    @property
    def any_fp8(self) -> bool:
        return self.weights == "fp8" or self.kv == "fp8"

    def check_device(self, device: torch.device) -> None:
        """Raise ``ValueError`` where this precision cannot run on ``device``."""
        if not self.any_fp8 or self.emulate:
            return
        what = " and ".join(f for f, on in (("quantization fp8", self.weights == "fp8"),
                                            ("kv_cache_dtype fp8", self.kv == "fp8")) if on)
        if device.type != "cuda":
            raise ValueError(f"{what}: FP8 needs a CUDA device with FP8 tensor cores (compute capability 8.9 or "
                             f"higher, e.g. H100); this runtime is on {device.type}")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"{what}: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) "
                             f"has no FP8 tensor cores; FP8 needs 8.9 or higher (Ada, Hopper)")

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model in ``dtype``: e4m3 for an FP8 cache (its emulation keeps ``dtype``)."""
        return E4M3 if self.kv == "fp8" and not self.emulate else dtype

    def check_kv_scales(self, kv_scales: dict[int, tuple[float, float]]) -> None:
        """An FP8 cache on the device runs at scale 1 (the kernels read e4m3 as it is): a checkpoint's other
        per-layer K/V scales are refused there rather than ignored (the emulation applies them)."""
        if self.kv != "fp8" or self.emulate:
            return
        other = {layer: s for layer, s in kv_scales.items() if s != (1.0, 1.0)}
        if other:
            layer, (k, v) = next(iter(sorted(other.items())))
            raise ValueError(f"kv_cache_dtype fp8: the checkpoint gives KV scales other than 1 (layer {layer}: k_scale "
                             f"{k}, v_scale {v}); the FP8 cache runs at scale 1 only so far (use the default KV "
                             f"dtype, or fp8_emulation)")

    def describe(self, dtype: torch.dtype) -> dict[str, str]:
        """Which precision each part runs in (the start-up log and ``/metrics``)."""
        model = str(dtype).removeprefix("torch.")
        fp8 = "fp8-e4m3-emulated" if self.emulate else "fp8-e4m3"
        kept = f"; layers {', '.join(map(str, self.keep_layers))} in {model}" if self.keep_layers else ""
        return {"linear": f"{fp8} (per channel) x {fp8} (per token){kept}" if self.weights == "fp8" else model,
                "kv_cache": (f"{fp8} (per-layer scale)" if self.emulate else f"{fp8} (scale 1)") if self.kv == "fp8"
                else model,
                "attention": model if model != "float32" else "float32", "embedding_lm_head_norms": model}


def token_scales(x: torch.Tensor) -> torch.Tensor:
    """x: [T, in] -> [T, 1] float32: each row's largest magnitude over E4M3_MAX, 1 for an all-zero row.
    No host synchronisation (CUDA graphs): a non-finite row yields non-finite outputs, as it would in
    the model dtype."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    return torch.where(amax > 0, over_e4m3_max(amax), torch.ones_like(amax))


class Fp8Linear(nn.Module):
    """A linear layer with FP8 weights (see the module docstring). ``weight`` is loaded through
    ``load_rows`` (full-precision rows are quantized per row, e4m3 rows copied with their scales)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, emulate: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.emulate = in_features, out_features, emulate
        self._split_k_rows: int | None = None           # see split_k
        store = torch.float32 if emulate else E4M3
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=store, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    @torch.no_grad()
    def load_rows(self, start: int, tensor: torch.Tensor) -> None:
        """Rows ``[start, start + len(tensor))`` of the weight from a checkpoint tensor: full precision is
        quantized per row (and sets those rows' scales); e4m3 is copied as it is (its scales come through
        ``load_scale_rows``)."""
        rows = slice(start, start + tensor.shape[0])
        if tensor.dtype == E4M3:
            self.weight[rows] = tensor.to(self.weight.device).to(self.weight.dtype)
            return
        q, scale = quantize_weight(tensor.to(self.weight.device))
        self.weight[rows] = q.to(self.weight.dtype)
        self.weight_scale[rows] = scale

    @torch.no_grad()
    def load_scale_rows(self, start: int, scale: torch.Tensor) -> None:
        """A checkpoint's scales of e4m3 rows ``[start, start + len(scale))``."""
        self.weight_scale[start:start + scale.shape[0]] = scale.to(self.weight_scale.device, torch.float32)

    @property
    def takes_quantized(self) -> bool:
        """Whether the kernel producing this layer's input should quantize it (``QuantizedRows``): the
        ``torch._scaled_mm`` path, which takes e4m3 rows as they come. The emulation quantizes its input
        by the torch ops itself (the reference numbers on the CPU)."""
        return not self.emulate

    def quantize_input(self, x: torch.Tensor) -> QuantizedRows:
        """x: [T, in] -> its rows quantized per token: one kernel where the fused kernels run, else torch ops
        (the emulation always: its reference numbers)."""
        if not self.emulate and fused(x):                                       # one kernel (GPU)
            from radixrelay.kernels.fp8_quant import quantize_rows

            q_x, s_x = quantize_rows(x.contiguous())                            # [T, in] e4m3, [T, 1]
        else:
            s_x = token_scales(x)                                               # [T, 1]
            q_x = (x.float() / s_x).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        return QuantizedRows(q_x, s_x, x.dtype)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """x: [..., in] in the model dtype, or ``QuantizedRows`` [T, in] -> [..., out] in that dtype."""
        if isinstance(x, QuantizedRows):
            if x.q.shape[1] != self.in_features:
                raise ValueError(f"Fp8Linear: quantized rows of {x.q.shape[1]} columns for {self.in_features} "
                                 f"inputs")
            lead, rows = x.q.shape[:-1], x
        else:
            lead, rows = x.shape[:-1], self.quantize_input(x.reshape(-1, self.in_features))
        q_x, s_x = rows.q, rows.scale                                           # [T, in] e4m3, [T, 1]
        if self.emulate:
            out = (q_x.float() @ self.weight.t()) * s_x * self.weight_scale[None, :]
            out = out.to(rows.dtype)
            if self.bias is not None:
                out = out + self.bias
        elif self.bias is None and self.split_k(q_x.shape[0]):                # few rows (kernels.fp8_gemm)
            from radixrelay.kernels.fp8_gemm import fp8_split_k

            out = fp8_split_k(q_x, s_x, self.weight, self.weight_scale, rows.dtype)
        else:
            out = torch._scaled_mm(q_x, self.weight.t(), scale_a=s_x, scale_b=self.weight_scale[None, :],
                                   bias=self.bias, out_dtype=rows.dtype)
        return out.reshape(*lead, self.out_features)

    def split_k(self, rows: int) -> bool:
        """Whether a product of ``rows`` rows runs split along K (``kernels.fp8_gemm``: few rows, few output
        columns, Hopper) instead of ``torch._scaled_mm``; the device half of the rule is asked once."""
        if self._split_k_rows is None:                  # the most rows it takes (0: never)
            from radixrelay.kernels.fp8_gemm import split_k_max_rows

            self._split_k_rows = 0 if self.emulate else split_k_max_rows(self.in_features, self.out_features,
                                                                         self.weight.device)
        return 0 < rows <= self._split_k_rows

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {'emulated' if self.emulate else 'e4m3'}")


def per_channel_scale(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A checkpoint's weight scale (per tensor: [] or [1]; per channel: [rows] or [rows, 1]) -> [rows] float32."""
    flat = scale.reshape(-1).float()
    if flat.numel() == 1:
        return flat.expand(rows).clone()
    if flat.numel() == rows:
        return flat
    raise ValueError(f"load_weights: {name!r} has {flat.numel()} scales for {rows} output channels (expected 1 "
                     f"or {rows})")


def dequantize_checkpoint(weight: torch.Tensor, scale: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """An e4m3 checkpoint weight [out, in] with its scale -> ``dtype`` (a model that does not run in FP8)."""
    return (weight.float() * per_channel_scale(scale, weight.shape[0], name)[:, None]).to(dtype)

