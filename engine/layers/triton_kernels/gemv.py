"""y = x W^T + b for one row of x: the linear layers of a batch-1 decode step.

At one token a linear layer is a weight stream, and inside a CUDA graph each GEMV also pays
its ramp-up after the kernel before it. This kernel issues the load of its whole weight
slice before it waits for its predecessor (the weights never depend on it; launched with
programmatic dependent launch, see triton_launch.py), so the stream starts while the norm
or activation before it is still running. Each program holds BLOCK_N rows of W whole in
registers: one load, every byte in flight at once, no split-K reduction kernel after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.engine.triton_launch import pdl_launch, wait_for_predecessor


@triton.jit
def _gemv(
    X,
    W,
    Bias,
    Y,
    N,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, K_PAD)
    col_mask = cols < K
    w = tl.load(
        W + rows.to(tl.int64)[:, None] * K + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
        eviction_policy="evict_first",  # read once per step: keep the L2 for activations
    )
    wait_for_predecessor(USE_PDL)  # x is the predecessor's output
    x = tl.load(X + cols, mask=col_mask, other=0.0)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=row_mask)


def gemv_block_rows(k: int) -> tuple[int, int]:
    """(rows per program, warps) for an input of k features: 8192 weights a program, or one
    row. On the H200 this was within 1 % of the best of 10 tile shapes for each Llama-3.1-8B
    layer; programs of 16384 weights or more were 2-25 % slower (benchmarks/README.md)."""
    return max(1, 8192 // triton.next_power_of_2(k)), 8


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias [N]) -> [1, N], in x's dtype, fp32 accumulation."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, got x of shape {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[1] != k or not weight.is_contiguous():
        raise ValueError(
            f"gemv needs a contiguous [N, {x.shape[1]}] weight, got {tuple(weight.shape)}"
        )
    default_block_n, default_warps = gemv_block_rows(k)
    block_n = block_n or default_block_n
    x = x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        K=k,
        K_PAD=triton.next_power_of_2(k),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        num_warps=num_warps or default_warps,
        **pdl_launch(x.device),
    )
    return y
