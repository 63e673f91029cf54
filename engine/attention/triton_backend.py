"""Attention with kubesgl's own Triton kernels (triton_kernels/). Decode reads only device
tensors, so decode steps can be captured in CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubesgl.engine.attention.base import AttentionBackend, AttentionLayerSpec
from kubesgl.engine.attention.triton_kernels.decode import decode_attention
from kubesgl.engine.attention.triton_kernels.extend import extend_attention
from kubesgl.engine.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _ExtendMeta:
    extend_lens: torch.Tensor
    q_starts: torch.Tensor
    max_extend: int


class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, kv_pool, req_to_token, layers):
        super().__init__(kv_pool, req_to_token, layers)
        from kubesgl.engine.attention import triton_supports

        if not all(triton_supports(layer.head_dim) for layer in layers):
            sizes = sorted({layer.head_dim for layer in layers})
            raise ValueError(
                f"--attention-backend triton needs power-of-two head sizes of at least 16, not {sizes}; "
                "use --attention-backend torch or flashinfer"
            )

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            batch.attn = None  # everything the kernel needs is in the batch already
            return
        lens = batch.extend_lens
        batch.attn = _ExtendMeta(lens, torch.cumsum(lens, 0) - lens, max(batch.extend_lens_cpu))

    def attend(
        self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch, out: torch.Tensor
    ) -> None:
        k_cache, v_cache = self.kv_pool.k[layer.layer_id], self.kv_pool.v[layer.layer_id]
        table = self.req_to_token.table
        if batch.mode is ForwardMode.DECODE:
            decode_attention(
                q,
                k_cache,
                v_cache,
                table,
                batch.req_rows,
                batch.seq_lens,
                layer.scaling,
                layer.sliding_window,
                out=out,
            )
            return
        meta: _ExtendMeta = batch.attn
        extend_attention(
            q,
            k_cache,
            v_cache,
            table,
            batch.req_rows,
            batch.seq_lens,
            meta.extend_lens,
            meta.q_starts,
            meta.max_extend,
            layer.scaling,
            layer.sliding_window,
            out=out,
        )
