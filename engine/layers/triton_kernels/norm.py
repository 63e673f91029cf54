"""RMS norm, optionally fused with the residual add before it: one read of each input and
one write of each output instead of the eight kernels of the torch expression. Rounds
where the torch path (and transformers) round: the sum to the model's dtype before it is
normed, the normed row to the dtype before the weight multiplies it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.engine.triton_launch import pdl_launch, wait_for_predecessor


@triton.jit
def _rms_norm(
    X,
    Residual,
    Weight,
    Out,
    SumOut,
    stride_x,
    stride_r,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # times a stride can pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x.to(tl.float32) + tl.load(Residual + row * stride_r + cols, mask=mask, other=0.0).to(
            tl.float32
        )
        x = x.to(SumOut.dtype.element_ty)
        tl.store(SumOut + row * N + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * inv_rms).to(Out.dtype.element_ty)
    weight = tl.load(Weight + cols, mask=mask)
    tl.store(
        Out + row * N + cols,
        (normed.to(tl.float32) * weight.to(tl.float32)).to(Out.dtype.element_ty),
        mask=mask,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) or, with a residual, (norm(x + residual), x + residual). Rows are the last dim."""
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    if residual is None:
        _rms_norm[(x2.shape[0],)](
            x2,
            x2,
            weight,
            out,
            out,
            x2.stride(0),
            0,
            n,
            eps,
            HAS_RESIDUAL=False,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),
            **pdl_launch(x.device),
        )
        return out.view(shape)
    r2 = residual.reshape(-1, n)
    summed = torch.empty_like(out)
    _rms_norm[(x2.shape[0],)](
        x2,
        r2,
        weight,
        out,
        summed,
        x2.stride(0),
        r2.stride(0),
        n,
        eps,
        HAS_RESIDUAL=True,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
        **pdl_launch(x.device),
    )
    return out.view(shape), summed.view(shape)
