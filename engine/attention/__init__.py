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


def _triton_problem(dtype: torch.dtype, head_dim: int) -> str | None:
    if triton_supports(head_dim):
        return None
    return (
        f"--attention-backend triton needs a power-of-two head size of at least 16, and "
        f"this model's is {head_dim}; use torch (or auto)"
    )


def _flashinfer_problem(dtype: torch.dtype, head_dim: int) -> str | None:
    if importlib.util.find_spec("flashinfer") is None:
        return (
            "--attention-backend flashinfer needs the flashinfer-python package "
            "(pip install 'kubesgl[flashinfer]')"
        )
    if dtype not in (torch.float16, torch.bfloat16):
        return "--attention-backend flashinfer needs --dtype bfloat16 or float16"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return (
            f"--attention-backend flashinfer needs a head size in {FLASHINFER_HEAD_DIMS}, and "
            f"this model's is {head_dim}; use triton, torch or auto"
        )
    return None


def _torch_problem(dtype: torch.dtype, head_dim: int) -> str | None:
    return None  # the reference: runs every dtype and head size


@dataclass(frozen=True)
class BackendEntry:
    """Where a backend's class lives (imported only when chosen: flashinfer may be absent), and
    why it cannot run a model of this dtype and head size on CUDA (None where it can): the
    message preflight refuses an explicit choice with, and what `auto` skips it for."""

    module: str
    class_name: str
    problem: Callable[[torch.dtype, int], str | None]

    def load(self) -> type[AttentionBackend]:
        return getattr(importlib.import_module(self.module), self.class_name)


# In order of preference for `auto` on CUDA: the fastest on the H200 first (benchmarks/README.md).
ATTENTION_BACKENDS: dict[AttentionBackendName, BackendEntry] = {
    "flashinfer": BackendEntry(
        "kubesgl.engine.attention.flashinfer_backend",
        "FlashInferAttentionBackend",
        _flashinfer_problem,
    ),
    "triton": BackendEntry(
        "kubesgl.engine.attention.triton_backend",
        "TritonAttentionBackend",
        _triton_problem,
    ),
    "torch": BackendEntry(
        "kubesgl.engine.attention.torch_backend",
        "TorchAttentionBackend",
        _torch_problem,
    ),
}


def auto_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionBackendName:
    """What `--attention-backend auto` picks: torch on the CPU; on CUDA, the first backend of the
    registry that fits the model (flashinfer where installed, else triton for power-of-two head
    sizes, else torch)."""
    if device.type != "cuda":
        return "torch"
    return next(
        name for name, entry in ATTENTION_BACKENDS.items() if entry.problem(dtype, head_dim) is None
    )


def create_backend(name: str, **kwargs) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is not available "
            f"(available: {', '.join(ATTENTION_BACKENDS)})"
        )
    return ATTENTION_BACKENDS[name].load()(**kwargs)


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionLayerSpec",
    "BackendEntry",
    "auto_backend",
    "create_backend",
    "triton_supports",
]
