"""Writes a step's K and V into the pool in one launch: row t of k and v goes to slot
`slots[t]`, converted to the pool's storage dtype. Values beyond an FP8 cache's range are
clamped to its largest finite value first (a plain cast may give NaN)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.engine.triton_launch import pdl_launch, wait_for_predecessor


@triton.jit
def _store_kv(
    K,
    V,
    KCache,
    VCache,
    Slots,
    stride_kt,
    stride_vt,
    stride_ct,
    limit,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    CLAMP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_predecessor(USE_PDL)
    t = tl.program_id(0).to(tl.int64)  # t * stride can pass 2**31
    slot = tl.load(Slots + t)
    cols = tl.arange(0, BLOCK)
    mask = cols < WIDTH
    k = tl.load(K + t * stride_kt + cols, mask=mask)
    v = tl.load(V + t * stride_vt + cols, mask=mask)
    if CLAMP:
        k = tl.clamp(
            k.to(tl.float32), -limit, limit, propagate_nan=tl.PropagateNan.ALL
        )  # NaN stays NaN
        v = tl.clamp(v.to(tl.float32), -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    tl.store(KCache + slot * stride_ct + cols, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + slot * stride_ct + cols, v.to(VCache.dtype.element_ty), mask=mask)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_cache, v_cache: [slots, kv_heads, dim] (contiguous); k, v: [T, kv_heads, dim] with
    contiguous heads and dims (views into the fused qkv output are fine)."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    width = k_cache.shape[1] * k_cache.shape[2]
    limit = fp8_limit(k_cache.dtype)
    _store_kv[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        v.stride(0),
        k_cache.stride(0),
        limit or 0.0,
        WIDTH=width,
        BLOCK=triton.next_power_of_2(width),
        CLAMP=limit is not None,
        **pdl_launch(k.device),
    )


def fp8_limit(dtype: torch.dtype) -> float | None:
    """The largest finite value of an FP8 dtype; None for wider dtypes."""
    return torch.finfo(dtype).max if dtype.itemsize == 1 else None
