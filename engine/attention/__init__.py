"""Attention backends: each reads and writes the paged KV pool for one forward step.

`ATTENTION_BACKENDS` is the registry: one entry adds a backend. Its names are the choices of
`--attention-backend`, declared as `AttentionBackendName` in engine/config.py (which the CLI and
the CRD read, torch-free); tests/unit/engine/test_attention_backends.py checks that the two agree.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kubesgl.engine.attention.base import AttentionBackend, AttentionLayerSpec
from kubesgl.engine.config import AttentionBackendName

FLASHINFER_HEAD_DIMS = (64, 128, 256)


def triton_supports(head_dim: int) -> bool:
    """kubesgl's Triton attention kernels work on whole power-of-two head sizes."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _flashinfer_fits(dtype: torch.dtype, head_dim: int) -> bool:
    return (
        importlib.util.find_spec("flashinfer") is not None
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim in FLASHINFER_HEAD_DIMS
    )


@dataclass(frozen=True)
class BackendEntry:
    """Where a backend's class lives (imported only when chosen: flashinfer may be absent), and
    whether `auto` may pick it on CUDA for a model's dtype and head size."""

    module: str
    class_name: str
    auto_on_cuda: Callable[[torch.dtype, int], bool]

    def load(self) -> type[AttentionBackend]:
        return getattr(importlib.import_module(self.module), self.class_name)


# In order of preference for `auto` on CUDA: the fastest on the H200 first (benchmarks/README.md).
ATTENTION_BACKENDS: dict[AttentionBackendName, BackendEntry] = {
    "flashinfer": BackendEntry(
        "kubesgl.engine.attention.flashinfer_backend",
        "FlashInferAttentionBackend",
        _flashinfer_fits,
    ),
    "triton": BackendEntry(
        "kubesgl.engine.attention.triton_backend",
        "TritonAttentionBackend",
        lambda dtype, head_dim: triton_supports(head_dim),
    ),
    "torch": BackendEntry(
        "kubesgl.engine.attention.torch_backend",
        "TorchAttentionBackend",
        lambda dtype, head_dim: True,
    ),
}


def auto_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionBackendName:
    """What `--attention-backend auto` picks: torch on the CPU; on CUDA, the first backend of the
    registry that fits the model (flashinfer where installed, else triton for power-of-two head
    sizes, else torch)."""
    if device.type != "cuda":
        return "torch"
    return next(
        name for name, entry in ATTENTION_BACKENDS.items() if entry.auto_on_cuda(dtype, head_dim)
    )


def create_backend(name: str, **kwargs) -> AttentionBackend:
    for known, entry in ATTENTION_BACKENDS.items():
        if known == name:
            return entry.load()(**kwargs)
    raise ValueError(
        f"attention backend {name!r} is not available (available: {', '.join(ATTENTION_BACKENDS)})"
    )


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionLayerSpec",
    "BackendEntry",
    "auto_backend",
    "create_backend",
    "triton_supports",
]
