"""Paged prefill ("extend") attention: each request's new tokens attend causally to its whole
KV, the cached prefix included, all read from the KV pool through the request table."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _extend(
    Q, K, V, Out, Table, Rows, SeqLens, ExtendLens, QStarts,
    sm_scale, window,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh, stride_table,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
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
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=mask_m[:, None],
                other=0.0)
    q_pos = prefix + offs_m

    hi = tl.minimum(seq_len, prefix + (block + 1) * BLOCK_M)  # no query of this block sees past here
    lo = prefix * 0  # typed like the loaded lengths (int64), as the branch below requires
    if window > 0:
        lo = tl.maximum(0, prefix + block * BLOCK_M - window + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        valid = k_pos < hi
        slots = tl.load(Table + row * stride_table + k_pos, mask=valid, other=0)
        k = tl.load(K + slots[:, None] * stride_kn + kv_head * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + slots[:, None] * stride_vn + kv_head * stride_vh + d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        allowed = valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if window > 0:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=mask_m[:, None])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor, q_starts: torch.Tensor,
                     max_extend: int, sm_scale: float, window: int | None) -> torch.Tensor:
    """q: [tokens, heads, dim], the new tokens of every request back to back. Returns the same shape."""
    tokens, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.empty_like(q)
    block_m = 32 if q.dtype == torch.float32 else 64
    grid = (rows.shape[0], heads, triton.cdiv(max_extend, block_m))
    _extend[grid](
        q, k_cache, v_cache, out, table, rows, seq_lens, extend_lens, q_starts,
        sm_scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), table.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=32, HEAD_DIM=dim, IEEE=q.dtype == torch.float32,
    )
    return out
