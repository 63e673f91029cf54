from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kubesgl.engine.forward_batch import ForwardBatch
from kubesgl.engine.kvcache.pools import KVPool, ReqToTokenTable


@dataclass(frozen=True)
class AttentionLayerSpec:
    layer_id: int
    num_heads: int  # on this rank
    num_kv_heads: int  # on this rank
    head_dim: int
    scaling: float
    sliding_window: int | None  # attend to this many latest positions, None = all

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q_size + 2 * kv_size] -> views q [T, heads, dim], k and v [T, kv_heads, dim]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
        )


class AttentionBackend(ABC):
    """Computes attention over the paged KV pool for the given `layers` (a backend that plans
    ahead, like FlashInfer, needs their shapes and windows up front).

    `prepare` runs once per step and leaves its metadata in `batch.attn`; `forward` runs per
    layer: it stores the step's k and v at `batch.out_cache_loc`, then `attend`s.
    """

    supports_cuda_graph = False  # decode reads only device tensors (no host values, no syncs)

    def __init__(
        self, kv_pool: KVPool, req_to_token: ReqToTokenTable, layers: Sequence[AttentionLayerSpec]
    ):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None: ...

    def attends_mixed_in_one_pass(self, batch: ForwardBatch) -> bool:
        """Whether a MIXED batch's rows (its prefill chunks and its decodes, one query each)
        are best attended as one extend batch, in one kernel, rather than as an extend batch
        and a decode batch (attention/mixed.py)."""
        return False

    def init_cuda_graph(self, max_batch_size: int) -> None:
        """Called once before decode graphs are captured for batches up to `max_batch_size`."""
        return None  # nothing to set up unless a backend keeps per-graph buffers

    def prepare_cuda_graph(self, batch: ForwardBatch) -> None:
        """`prepare` for a decode batch padded to a captured size: before its capture and
        before every replay. Captured kernels keep the addresses they were captured with,
        so whatever they read must live in buffers fixed per batch size."""
        self.prepare(batch)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q: [T, heads, dim]; k, v: [T, kv_heads, dim]. Returns attention's output
        [T, heads, dim]. (Piecewise CUDA graphs store K and V inside their pieces and call
        `attend` with their own output buffer.)"""
        self.kv_pool.write(layer.layer_id, batch.out_cache_loc, k, v)
        out = q.new_empty(q.shape)
        self.attend(q, layer, batch, out)
        return out

    @abstractmethod
    def attend(
        self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch, out: torch.Tensor
    ) -> None:
        """Attention of q over the pool, where this step's k and v are stored already,
        written into out."""
