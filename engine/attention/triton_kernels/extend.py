"""Paged prefill ("extend") attention: each request's new tokens attend causally to its whole
KV, the cached prefix included, all read from the KV pool through the request table."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.engine.attention.triton_kernels.online_softmax import (
    block_scores,
    load_kv_block,
    online_softmax_step,
)


@triton.jit
def _extend(
    Q,
    K,
    V,
    Out,
    Table,
    Rows,
    SeqLens,
    ExtendLens,
    QStarts,
    sm_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_table,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    extend_len = tl.load(ExtendLens + b)
    if block * BLOCK_M >= extend_len:
        return
    seq_len = tl.load(SeqLens + b)
    prefix = seq_len - extend_len
    q_start = tl.load(QStarts + b)
    row = tl.load(Rows + b)
    kv_head = head // GROUP
    d = tl.arange(0, HEAD_DIM)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < extend_len
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=mask_m[:, None],
        other=0.0,
    )
    q_pos = prefix + offs_m

    # no query of this block sees past here
    hi = tl.minimum(seq_len, prefix + (block + 1) * BLOCK_M)
    lo = prefix * 0  # typed like the loaded lengths (int64), as the branch below requires
    if window > 0:
        lo = tl.maximum(0, prefix + block * BLOCK_M - window + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        valid = k_pos < hi
        k, v = load_kv_block(
            K,
            V,
            Table,
            row * stride_table,
            k_pos,
            valid,
            kv_head,
            stride_kn,
            stride_kh,
            stride_vn,
            stride_vh,
            d,
            q.dtype,
        )
        allowed = valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if window > 0:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, block_scores(q, k, IEEE) * sm_scale, float("-inf"))
        acc, m_i, l_i = online_softmax_step(s, v, acc, m_i, l_i, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_starts: torch.Tensor,
    max_extend: int,
    sm_scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [tokens, heads, dim], the new tokens of every request back to back. Returns the
    same shape, written into `out` when given."""
    tokens, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    if out is None:
        out = q.new_empty(q.shape)
    block_m = 32 if q.dtype == torch.float32 else 64
    grid = (rows.shape[0], heads, triton.cdiv(max_extend, block_m))
    _extend[grid](
        q,
        k_cache,
        v_cache,
        out,
        table,
        rows,
        seq_lens,
        extend_lens,
        q_starts,
        sm_scale,
        window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        table.stride(0),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=32,
        HEAD_DIM=dim,
        IEEE=q.dtype == torch.float32,
    )
    return out
