"""Attention for MIXED steps (a prefill chunk and the running decodes in one forward pass),
through any backend: the prefill rows run as an extend batch and the decode rows as a decode
batch, each prepared and attended by the backend exactly as it runs such a batch alone (the
step's k and v are stored once, for all rows). The decode rows so keep the backend's decode
kernel (split KV, each KV head read once for its group of query heads), which an extend
kernel's tiles of one query would not. Where the backend finds one extend pass over all rows
faster (`attends_mixed_in_one_pass`: short contexts, where that waste is small and one launch
less per layer is not), the whole batch is attended as one extend batch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kubesgl.engine.attention.base import AttentionBackend, AttentionLayerSpec
from kubesgl.engine.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _MixedMeta:
    extend: ForwardBatch  # the prefill rows (or all rows, in one pass), prepared by the backend
    decode: ForwardBatch | None  # the decode rows, prepared by the backend; None in one pass
    extend_tokens: int  # the prefill rows' tokens come first in q, k and v (all, in one pass)


class MixedAttention(AttentionBackend):
    def __init__(self, backend: AttentionBackend):
        super().__init__(backend.kv_pool, backend.req_to_token, [])
        self.backend = backend

    def prepare(self, batch: ForwardBatch) -> None:
        assert batch.mode is ForwardMode.MIXED, batch.mode
        if self.backend.attends_mixed_in_one_pass(batch):
            whole = dataclasses.replace(batch, mode=ForwardMode.EXTEND, prefill_rows=0, attn=None)
            self.backend.prepare(whole)
            batch.attn = _MixedMeta(whole, None, whole.num_tokens)
            return
        extend, decode = batch.split_mixed()
        self.backend.prepare(extend)
        self.backend.prepare(decode)
        batch.attn = _MixedMeta(extend, decode, extend.num_tokens)

    def attend(
        self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch, out: torch.Tensor
    ) -> None:
        meta: _MixedMeta = batch.attn
        if meta.decode is None:
            self.backend.attend(q, layer, meta.extend, out)
            return
        n = meta.extend_tokens
        self.backend.attend(q[:n], layer, meta.extend, out[:n])
        self.backend.attend(q[n:], layer, meta.decode, out[n:])
