"""Attention backends: each reads and writes the paged KV pool for one forward step."""

from __future__ import annotations

import importlib.util

import torch

from kubesgl.engine.attention.base import AttentionBackend, AttentionLayerSpec

FLASHINFER_HEAD_DIMS = (64, 128, 256)


def auto_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """What `--attention-backend auto` picks: torch on the CPU; on CUDA, flashinfer where it is
    installed and supports the model (the fastest on the H200, benchmarks/README.md), else
    triton where its kernels do (power-of-two head sizes), else torch."""
    if device.type != "cuda":
        return "torch"
    if (importlib.util.find_spec("flashinfer") is not None and dtype in (torch.float16, torch.bfloat16)
            and head_dim in FLASHINFER_HEAD_DIMS):
        return "flashinfer"
    return "triton" if triton_supports(head_dim) else "torch"


def triton_supports(head_dim: int) -> bool:
    """kubesgl's Triton attention kernels work on whole power-of-two head sizes."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def create_backend(name: str, **kwargs) -> AttentionBackend:
    if name == "torch":
        from kubesgl.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(**kwargs)
    if name == "triton":
        from kubesgl.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(**kwargs)
    if name == "flashinfer":
        from kubesgl.engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(**kwargs)
    raise ValueError(f"attention backend {name!r} is not available (available: torch, triton, flashinfer)")


__all__ = ["AttentionBackend", "AttentionLayerSpec", "auto_backend", "create_backend", "triton_supports"]
