"""The RMS norm before a column-parallel linear layer (qkv_proj, a dense MLP's gate_up_proj),
and optionally the two in one kernel (triton_kernels/norm_gemv.py) for batches of up to 16
tokens, where the norm's own launch is a measurable share of a decode step.

Off by default: an experiment, turned on for a process by `enable_fused_norm_linear`
(`benchmarks/decode_latency.py --fused-norm-gemv`). When on, it runs on CUDA, or on the CPU
in Triton's interpreter (TRITON_INTERPRET=1), which is how the tests run it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubesgl.engine.layers.linear import ColumnParallelLinear
from kubesgl.engine.layers.norm import RMSNorm


@dataclass(frozen=True)
class FusedNormLinear:
    pdl: bool  # programmatic dependent launch, where the device has it (compute capability 9.0+)


_fused: FusedNormLinear | None = None


def enable_fused_norm_linear(setting: FusedNormLinear | None) -> None:
    """Turn the fused kernel on (a setting) or off (None) for models run from now on; a CUDA
    graph keeps the kernels it captured."""
    global _fused
    _fused = setting


def norm_linear(norm: RMSNorm, linear: ColumnParallelLinear, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual), the residual stream; without a residual
    (the first layer), (linear(norm(x)), x)."""
    if _fused is not None:
        from kubesgl.engine.layers.triton_kernels.norm_gemv import (
            MAX_ROWS,
            pdl_supported,
            rms_norm_linear,
        )

        if x.shape[0] <= MAX_ROWS:
            return rms_norm_linear(x, norm.weight, norm.eps, linear.weight, linear.bias, residual,
                                   pdl=_fused.pdl and pdl_supported(x.device))
    if residual is None:
        return linear(norm(x)), x
    normed, summed = norm(x, residual)
    return linear(normed), summed
