"""silu(gate) * up in one kernel over a [tokens, 2 * width] tensor laid out [gate | up].
silu's result is rounded to the model's dtype before the product, as in the torch path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.engine.triton_launch import pdl_launch, wait_for_predecessor


@triton.jit
def _silu_and_mul(X, Out, stride_x, width, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    t = tl.program_id(0).to(tl.int64)  # times a stride can pass 2**31
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(X + t * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + t * stride_x + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(
        Out + t * width + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    width = x2.shape[1] // 2
    out = torch.empty((x2.shape[0], width), dtype=x.dtype, device=x.device)
    block = 1024
    if x2.shape[0]:
        _silu_and_mul[(x2.shape[0], triton.cdiv(width, block))](
            x2, out, x2.stride(0), width, BLOCK=block, **pdl_launch(x.device)
        )
    return out.view(*x.shape[:-1], width)
