"""Device memory of the KV cache: K and V per layer, and the request-to-token table."""

from __future__ import annotations

import torch


class KVPool:
    """K and V buffers of every layer, indexed by token slot: [slots, kv_heads, head_dim].

    Stored in `dtype`, which may be narrower than the model's (`--kv-cache-dtype fp8_e4m3`
    halves the bytes per token); attention reads values back as `compute_dtype`. The slots
    are grouped into pages of `page_size` consecutive slots (the allocator's), which a
    request's tokens fill in order: a backend may read the pool as [pages, page_size, ...]."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
        page_size: int = 1,
    ):
        if num_slots % page_size:
            raise ValueError(f"{num_slots} slots are not a whole number of {page_size}-slot pages")
        shape = (num_slots, num_kv_heads, head_dim)
        self.num_slots, self.page_size = num_slots, page_size
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.is_cuda and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (k, v)):
            from kubesgl.engine.kvcache.store_kv import store_kv

            store_kv(self.k[layer], self.v[layer], slots, k, v)
            return
        if self.dtype.itemsize == 1:  # FP8: a plain cast may turn out-of-range values into NaN
            limit = torch.finfo(self.dtype).max
            k, v = k.clamp(-limit, limit), v.clamp(-limit, limit)
        self.k[layer][slots] = k.to(self.dtype)
        self.v[layer][slots] = v.to(self.dtype)


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
