"""Paged decode attention: one new query token per request against its whole KV.

Split-KV ("flash decoding"): each request's keys are cut into NUM_SPLITS ranges handled by
separate programs, so that a batch of one long request still fills the GPU; a second kernel
merges the partial results by their log-sum-exp. Each program serves one KV head and all
the query heads that share it (grouped-query attention), so K and V are read once per group.
The kernel reads lengths and slots from device tensors only: it can be captured in a CUDA
graph and replayed for any sequence lengths.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kubesgl.engine.attention.triton_kernels.online_softmax import (
    block_scores,
    load_kv_block,
    online_softmax_step,
)


@triton.jit
def _decode_partial(
    Q,
    K,
    V,
    Table,
    Rows,
    SeqLens,
    PartOut,
    PartLse,
    sm_scale,
    window,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_table,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    h = tl.arange(0, BLOCK_H)
    head_mask = h < GROUP
    heads = kv_head * GROUP + h
    d = tl.arange(0, HEAD_DIM)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(Rows + b)
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=head_mask[:, None],
        other=0.0,
    )

    per_split = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    if window > 0:  # the query at position seq_len - 1 sees the last `window` keys
        start = tl.maximum(start, seq_len - window)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        k, v = load_kv_block(
            K,
            V,
            Table,
            row * stride_table,
            offs,
            valid,
            kv_head,
            stride_kn,
            stride_kh,
            stride_vn,
            stride_vh,
            d,
            q.dtype,
        )
        s = tl.where(valid[None, :], block_scores(q, k, IEEE) * sm_scale, float("-inf"))
        acc, m_i, l_i = online_softmax_step(s, v, acc, m_i, l_i, IEEE)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(
        PartOut + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
        out,
        mask=head_mask[:, None],
    )
    tl.store(PartLse + b * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _decode_merge(
    PartOut,
    PartLse,
    Out,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # One program per request and query head: the splits' outputs weighted by their share of
    # the softmax mass.
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + s)
    weights = tl.exp(lse - tl.max(lse, 0))  # empty splits have lse -inf: weight 0
    weights = weights / tl.sum(weights, 0)
    parts = tl.load(PartOut + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :])
    out = tl.sum(parts * weights[:, None], 0)
    tl.store(Out + b * stride_outb + h * stride_outh + d, out.to(Out.dtype.element_ty))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(programs_per_split: int, device: torch.device) -> int:
    """8 splits, or more (up to 32) where that is too few programs for about two per
    multiprocessor: a batch of one reads a long KV twice as fast over 32 splits as over 8.
    Fixed per batch size, as a CUDA graph needs. Fewer than 8 for large batches was faster
    at short contexts and slower at long ones on the H200 (benchmarks/README.md), so it is
    not done: a split count that follows the context length is the next step."""
    if device.type != "cuda":
        return 8
    wanted = max(8, 2 * _multiprocessors(device) // programs_per_split)
    return min(32, triton.next_power_of_2(wanted))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int | None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, heads, dim]; caches: [slots, kv_heads, dim]. Returns [B, heads, dim], written
    into `out` when given (its last dimension contiguous). num_splits: a power of two, by
    default enough for the batch to fill the device."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(batch * kv_heads, q.device)
    assert num_splits > 0 and num_splits & (num_splits - 1) == 0, num_splits
    group = heads // kv_heads
    part_out = torch.empty((batch, heads, num_splits, dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_partial[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        table,
        rows,
        seq_lens,
        part_out,
        part_lse,
        sm_scale,
        window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=32,
        HEAD_DIM=dim,
        NUM_SPLITS=num_splits,
        IEEE=q.dtype == torch.float32,
    )
    if out is None:
        out = q.new_empty(q.shape)
    _decode_merge[(batch, heads)](
        part_out,
        part_lse,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        HEAD_DIM=dim,
    )
    return out
