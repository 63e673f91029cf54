"""Flattens the request-to-token table into the ragged list of KV slots that FlashInfer
reads: the first `seq_len` slots of each request's row, one request after another. One
program per request, one launch per step, no host synchronisation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_kv_indices(Table, stride_table, Rows, Starts, SeqLens, Out, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(Rows + b)
    start = tl.load(Starts + b)
    seq_len = tl.load(SeqLens + b)
    for col in range(0, seq_len, BLOCK):
        offsets = col + tl.arange(0, BLOCK)
        mask = offsets < seq_len
        slots = tl.load(Table + row * stride_table + offsets, mask=mask)
        tl.store(Out + start + offsets, slots.to(tl.int32), mask=mask)


def gather_kv_indices(
    table: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor, total: int
) -> torch.Tensor:
    """int32 slots of rows `req_rows` up to `seq_lens`, concatenated; `total` = sum(seq_lens)."""
    out = torch.empty(total, dtype=torch.int32, device=table.device)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    _gather_kv_indices[(len(req_rows),)](
        table, table.stride(0), req_rows, starts, seq_lens, out, BLOCK=512
    )
    return out
