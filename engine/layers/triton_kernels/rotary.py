"""Rotary embedding of q and k in one launch, in place. One program per token reads its
position's cos and sin once for all heads. Products and the sum are rounded to the model's
dtype one by one, as the torch expression (and transformers) round them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.engine.triton_launch import pdl_launch, wait_for_predecessor


@triton.jit
def _rotate_heads(
    X,
    stride_t,
    stride_h,
    t,
    cos,
    sin,
    half,
    HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = (h < HEADS) & (d < half)
    first = X + t * stride_t + h * stride_h + d
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    dtype = x1.dtype
    a = (x1.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b = (x2.to(tl.float32) * sin).to(dtype).to(tl.float32)
    c = (x2.to(tl.float32) * cos).to(dtype).to(tl.float32)
    e = (x1.to(tl.float32) * sin).to(dtype).to(tl.float32)
    tl.store(first, (a - b).to(dtype), mask=mask)
    tl.store(first + half, (c + e).to(dtype), mask=mask)


@triton.jit
def _rotary(
    Q,
    K,
    Positions,
    Cos,
    Sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    half,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_predecessor(USE_PDL)
    t = tl.program_id(0).to(tl.int64)  # times a stride can pass 2**31
    pos = tl.load(Positions + t)
    d = tl.arange(0, HALF)[None, :]
    # cos and sin are float32 tables; the torch path first rounds them to the model's dtype
    cos = (
        tl.load(Cos + pos * stride_cos + d, mask=d < half, other=0.0)
        .to(Q.dtype.element_ty)
        .to(tl.float32)
    )
    sin = (
        tl.load(Sin + pos * stride_cos + d, mask=d < half, other=0.0)
        .to(Q.dtype.element_ty)
        .to(tl.float32)
    )
    _rotate_heads(Q, stride_qt, stride_qh, t, cos, sin, half, Q_HEADS, BLOCK_QH, HALF)
    _rotate_heads(K, stride_kt, stride_kh, t, cos, sin, half, K_HEADS, BLOCK_KH, HALF)


def apply_rotary_inplace(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """q: [T, heads, dim], k: [T, kv_heads, dim] (any token and head strides, dims contiguous);
    cos, sin: [max_positions, dim / 2] float32."""
    tokens, q_heads, dim = q.shape
    k_heads = k.shape[1]
    if tokens == 0:
        return
    _rotary[(tokens,)](
        q,
        k,
        positions,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        dim // 2,
        Q_HEADS=q_heads,
        K_HEADS=k_heads,
        BLOCK_QH=triton.next_power_of_2(q_heads),
        BLOCK_KH=triton.next_power_of_2(k_heads),
        HALF=triton.next_power_of_2(dim // 2),
        **pdl_launch(q.device),
    )
