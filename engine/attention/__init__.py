"""Attention backends: each reads and writes the paged KV pool for one forward step."""

from __future__ import annotations

from kubesgl.engine.attention.base import AttentionBackend, AttentionLayerSpec


def create_backend(name: str, **kwargs) -> AttentionBackend:
    if name == "torch":
        from kubesgl.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(**kwargs)
    if name == "triton":
        from kubesgl.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(**kwargs)
    raise ValueError(f"attention backend {name!r} is not available (available: torch, triton)")


__all__ = ["AttentionBackend", "AttentionLayerSpec", "create_backend"]
