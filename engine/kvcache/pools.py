"""Device memory of the KV cache: K and V per layer, and the request-to-token table."""

from __future__ import annotations

import torch


class KVPool:
    """K and V buffers of every layer, indexed by token slot: [slots, kv_heads, head_dim]."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_slots, num_kv_heads, head_dim)
        self.num_slots = num_slots
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][slots] = k
        self.v[layer][slots] = v


class ReqToTokenTable:
    """Row r, column p: the KV slot of position p of the request holding row r.

    Rows are handed out by the scheduler; the table itself is written only by the executor,
    from the writes a batch carries, so that every change is ordered with the forward
    passes that read it.
    """

    def __init__(self, num_rows: int, max_context_len: int, device: torch.device):
        self.num_rows = num_rows
        self.max_context_len = max_context_len
        self.table = torch.zeros((num_rows, max_context_len), dtype=torch.int64, device=device)

    def write(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        self.table[rows, cols] = slots
