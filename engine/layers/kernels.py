"""Which implementation the layers run: the fused Triton kernels (CUDA) or plain torch.

The model chooses once, from its device, and hands the choice to every layer it builds, so no
layer inspects its tensors' device on the hot path."""

from __future__ import annotations

from typing import Literal

import torch

LayerKernels = Literal["torch", "triton"]


def layer_kernels(device: torch.device) -> LayerKernels:
    """The fused Triton kernels on CUDA; torch elsewhere (Triton compiles for GPUs only)."""
    return "triton" if device.type == "cuda" else "torch"
