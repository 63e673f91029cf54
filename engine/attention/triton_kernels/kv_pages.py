"""Flattens the request-to-token table into the ragged list of KV pages that FlashInfer
reads: the pages holding the first `seq_len` tokens of each request's row, one request after
another. A request's tokens fill its pages in order, so page i of a request is the page of
its token i * page_size. One program per request, one launch per step, no host
synchronisation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_kv_pages(
    Table, stride_table, Rows, Starts, NumPages, Out, PAGE: tl.constexpr, BLOCK: tl.constexpr
):
    b = tl.program_id(0)
    row = tl.load(Rows + b)
    start = tl.load(Starts + b)
    num_pages = tl.load(NumPages + b)
    for first in range(0, num_pages, BLOCK):
        pages = first + tl.arange(0, BLOCK)
        mask = pages < num_pages
        slots = tl.load(Table + row * stride_table + pages * PAGE, mask=mask)
        tl.store(Out + start + pages, (slots // PAGE).to(tl.int32), mask=mask)


def gather_kv_pages(
    table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    total_pages: int,
) -> torch.Tensor:
    """int32 pages of rows `req_rows` up to `seq_lens` tokens, concatenated; `total_pages` =
    the sum of each request's ceil(seq_len / page_size). With pages of one token: slots."""
    out = torch.empty(total_pages, dtype=torch.int32, device=table.device)
    num_pages = (seq_lens + page_size - 1) // page_size
    starts = torch.cumsum(num_pages, 0) - num_pages
    _gather_kv_pages[(len(req_rows),)](
        table, table.stride(0), req_rows, starts, num_pages, out, PAGE=page_size, BLOCK=512
    )
    return out
