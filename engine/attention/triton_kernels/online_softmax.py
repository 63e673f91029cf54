"""The steps that the decode and extend kernels share: read a block of keys and values
through the request table, score it, and fold it into a running (flash-attention) softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_block(
    K,
    V,
    Table,
    row_offset,
    k_pos,
    valid,
    kv_head,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    d,
    dtype: tl.constexpr,
):
    """Keys and values at positions `k_pos` of one request (its table row starts at
    `row_offset`), as [BLOCK_N, HEAD_DIM] in `dtype`: a narrower cache (FP8) is widened here."""
    slots = tl.load(Table + row_offset + k_pos, mask=valid, other=0)
    k = tl.load(
        K + slots[:, None] * stride_kn + kv_head * stride_kh + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    v = tl.load(
        V + slots[:, None] * stride_vn + kv_head * stride_vh + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    return k.to(dtype), v.to(dtype)


@triton.jit
def block_scores(q, k, IEEE: tl.constexpr):
    if IEEE:  # float32 models: no TF32 rounding, so the CPU and GPU paths agree
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def online_softmax_step(s, v, acc, m_i, l_i, IEEE: tl.constexpr):
    """Folds masked scores `s` ([rows, BLOCK_N], -inf where not allowed) and their values into
    the running max `m_i`, sum `l_i` and output `acc`. Rows with nothing allowed yet stay empty."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i
