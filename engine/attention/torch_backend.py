"""Reference attention in plain torch: works on any device, used for correctness and on CPU.

Prefill attends per request (each request's queries against its whole KV, prefix included);
decode gathers every request's KV into one padded batch and masks the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kubesgl.engine.attention.base import AttentionBackend, AttentionLayerSpec
from kubesgl.engine.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _ExtendMeta:
    query_ranges: list[tuple[int, int]]  # [start, end) of each request's new tokens
    kv_slots: list[torch.Tensor]  # KV slots of each request's whole sequence
    query_positions: list[torch.Tensor]  # positions of each request's new tokens


@dataclass
class _DecodeMeta:
    kv_slots: torch.Tensor  # [B, max_len], padding points at slot 0
    key_positions: torch.Tensor  # [max_len]
    query_positions: torch.Tensor  # [B]
    valid: torch.Tensor  # [B, max_len] bool


def _mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal mask (optionally a sliding window): True where a query may see a key."""
    allowed = key_pos.unsqueeze(0) <= query_pos.unsqueeze(-1)
    if window is not None:
        allowed &= key_pos.unsqueeze(0) > query_pos.unsqueeze(-1) - window
    return allowed


class TorchAttentionBackend(AttentionBackend):
    def prepare(self, batch: ForwardBatch) -> None:
        table = self.req_to_token.table
        if batch.mode is ForwardMode.DECODE:
            max_len = max(batch.seq_lens_cpu)
            key_positions = torch.arange(max_len, device=table.device)
            valid = key_positions.unsqueeze(0) < batch.seq_lens.unsqueeze(1)
            slots = table[batch.req_rows, :max_len].masked_fill(~valid, 0)
            batch.attn = _DecodeMeta(slots, key_positions, batch.seq_lens - 1, valid)
            return
        ranges: list[tuple[int, int]] = []
        req_slots: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        start = 0
        for i, (seq_len, extend_len) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
            ranges.append((start, start + extend_len))
            # a slice, not req_rows[i]: indexing by a 0-dim device tensor reads it back (.item())
            req_slots.append(table[batch.req_rows[i : i + 1], :seq_len][0])
            positions.append(torch.arange(seq_len - extend_len, seq_len, device=table.device))
            start += extend_len
        batch.attn = _ExtendMeta(ranges, req_slots, positions)

    def attend(
        self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch, out: torch.Tensor
    ) -> None:
        k_cache, v_cache = self.kv_pool.k[layer.layer_id], self.kv_pool.v[layer.layer_id]
        gqa = layer.num_heads != layer.num_kv_heads
        meta = batch.attn
        if isinstance(meta, _DecodeMeta):
            keys = k_cache[meta.kv_slots].to(q.dtype).transpose(1, 2)  # [B, kv_heads, max_len, dim]
            values = v_cache[meta.kv_slots].to(q.dtype).transpose(1, 2)
            mask = meta.valid & _mask(
                meta.query_positions, meta.key_positions, layer.sliding_window
            )
            out.copy_(
                F.scaled_dot_product_attention(
                    q.unsqueeze(2),
                    keys,
                    values,
                    attn_mask=mask[:, None, None, :],
                    scale=layer.scaling,
                    enable_gqa=gqa,
                ).squeeze(2)
            )
            return
        for (start, end), slots, query_pos in zip(
            meta.query_ranges, meta.kv_slots, meta.query_positions
        ):
            key_pos = torch.arange(slots.shape[0], device=q.device)
            mask = _mask(query_pos, key_pos, layer.sliding_window)
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                k_cache[slots].to(q.dtype).transpose(0, 1),
                v_cache[slots].to(q.dtype).transpose(0, 1),
                attn_mask=mask,
                scale=layer.scaling,
                enable_gqa=gqa,
            ).transpose(0, 1)
