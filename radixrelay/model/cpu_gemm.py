"""The model's matrix products on the CPU: oneDNN's float32 matmul, or torch's default (BLAS).

On the CPU the projections and the LM head are most of a step. torch's float32 ``F.linear`` calls
MKL's sgemm; oneDNN's float32 matmul (the op torch's own compiler emits for CPU linears,
``torch.ops.mkldnn._linear_pointwise``, here with plain [out, in] weights, no packing) is faster for
every shape of the default model measured (``benchmarks/results/engine/cpu_engine.md``). Both are IEEE
float32 arithmetic: only the order of the sums differs, so the results agree to float32 rounding (a
relative error growing with the length of the sums), not bit for bit.

Modes (``set_cpu_gemm``; ``RADIXRELAY_CPU_GEMM`` sets the default, see ``radixrelay.env``):
- ``auto``: oneDNN for float32 CPU tensors when this torch has it (and it passes a check on first
  use: a float32 result within float32 rounding of the float64 product); ``F.linear`` otherwise.
- ``onednn``: the same, and an error if oneDNN cannot run.
- ``blas``: ``F.linear`` everywhere (transformers' arithmetic on the CPU; for comparisons).
Other devices and dtypes always use ``F.linear``.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from radixrelay.env import CPU_GEMM_MODES

logger = logging.getLogger("radixrelay.model")

MODES = CPU_GEMM_MODES
_mode = os.environ.get("RADIXRELAY_CPU_GEMM") or "auto"
_onednn_ok: bool | None = None        # the first-use check's verdict (None: not run yet)


def set_cpu_gemm(mode: str) -> None:
    """Choose how float32 CPU products run: "auto", "onednn" or "blas" (see the module docstring)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"set_cpu_gemm: mode must be one of {', '.join(MODES)}, got {mode!r}")
    _mode = mode


def cpu_gemm_mode() -> str:
    """The mode in force; raises ``ValueError`` for a bad ``RADIXRELAY_CPU_GEMM``."""
    if _mode not in MODES:
        raise ValueError(f"RADIXRELAY_CPU_GEMM must be one of {', '.join(MODES)}, got {_mode!r}")
    return _mode


def uses_onednn(x: torch.Tensor) -> bool:
    """Whether ``linear`` runs products with ``x`` (the activations) through oneDNN."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    mode = cpu_gemm_mode()
    if mode == "blas":
        return False
    ok = _onednn_ok if _onednn_ok is not None else _check_onednn()
    if not ok and mode == "onednn":
        raise RuntimeError("RADIXRELAY_CPU_GEMM=onednn, but oneDNN's float32 matmul is not usable in this "
                           "torch build (see the log); use auto or blas")
    return ok


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., in], weight [out, in], bias [out] -> [..., out]; through
    oneDNN for float32 CPU activations (``uses_onednn``)."""
    if uses_onednn(x) and weight.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _check_onednn() -> bool:
    """Run oneDNN's float32 matmul once on a small product against float64; remember the verdict.
    Fails (False, logged) when the op is missing, raises, or computes at lower precision (e.g. torch's
    oneDNN float32 math mode set to bfloat16 or tf32)."""
    global _onednn_ok
    try:
        if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
            raise RuntimeError("oneDNN is not available or disabled (torch.backends.mkldnn)")
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 384, generator=gen)
        w = torch.randn(96, 384, generator=gen)
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        ref = x.double() @ w.double().t()
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        if got.shape != ref.shape or got.dtype != torch.float32 or not err < 1e-5:
            raise RuntimeError(f"oneDNN float32 matmul off by {err:.1e} of the float64 product")
        _onednn_ok = True
    except Exception as exc:  # noqa: BLE001 - any failure means: use F.linear
        logger.warning("CPU products run through F.linear: %s", exc)
        _onednn_ok = False
    return _onednn_ok
