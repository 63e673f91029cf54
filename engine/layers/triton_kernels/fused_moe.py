"""Fused mixture-of-experts: every expert's matrix products in one grouped-GEMM launch.

The (token, choice) pairs are sorted by expert and each expert's run is padded to a whole
number of BLOCK_M rows, so that every block of rows belongs to one expert; one program
computes one (row block, column block) tile against that expert's weights. All shapes are
bounded by the batch, not by the routing, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class ExpertBlocks:
    sorted_pairs: torch.Tensor  # [capacity] (token * top_k + choice), padding = num_pairs
    block_experts: torch.Tensor  # [capacity // block_m] expert of each row block
    num_blocks: torch.Tensor  # [1] row blocks in use
    block_m: int


def align_to_experts(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """experts: [tokens, top_k] expert ids. Groups the pairs by expert, padded to block_m."""
    flat = experts.flatten()
    num_pairs = flat.numel()
    capacity = (triton.cdiv(num_pairs, block_m) + num_experts) * block_m
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded  # first row of each expert's run
    order = torch.argsort(flat, stable=True)
    rank_in_expert = (
        torch.arange(num_pairs, device=flat.device)
        - (torch.cumsum(counts, 0) - counts)[flat[order]]
    )
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[starts[flat[order]] + rank_in_expert] = order
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(torch.cumsum(padded, 0), block_starts, right=True).clamp(
        max=num_experts - 1
    )
    return ExpertBlocks(sorted_pairs, block_experts, (padded.sum() // block_m).view(1), block_m)


@triton.jit
def _grouped_gemm(
    A,
    W,
    C,
    Pairs,
    BlockExperts,
    NumBlocks,
    RowScale,
    num_pairs,
    N,
    K,
    a_row_divisor,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    IEEE: tl.constexpr,
):
    block = tl.program_id(0)
    if block >= tl.load(NumBlocks):
        return
    pid_n = tl.program_id(1)
    pairs = tl.load(Pairs + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_valid = pairs < num_pairs
    a_rows = pairs // a_row_divisor  # the token (first GEMM) or the pair itself (second)
    expert = tl.load(BlockExperts + block)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        a = tl.load(
            A + a_rows[:, None] * stride_am + ks[None, :],
            mask=row_valid[:, None] & k_valid[None, :],
            other=0.0,
        )
        w = tl.load(
            W + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=col_valid[None, :] & k_valid[:, None],
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if SCALE_ROWS:
        acc *= tl.load(RowScale + pairs, mask=row_valid, other=0.0)[:, None]
    tl.store(
        C + pairs[:, None] * stride_cm + cols[None, :],
        acc.to(C.dtype.element_ty),
        mask=row_valid[:, None] & col_valid[None, :],
    )


def _grouped_matmul(
    a: torch.Tensor,
    weights: torch.Tensor,
    blocks: ExpertBlocks,
    num_pairs: int,
    a_row_divisor: int,
    row_scale: torch.Tensor | None,
) -> torch.Tensor:
    """out[pair] = a[pair // a_row_divisor] @ weights[expert of pair]^T (times row_scale[pair])."""
    n, k = weights.shape[1], weights.shape[2]
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    block_n = 64
    grid = (blocks.block_experts.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm[grid](
        a,
        weights,
        out,
        blocks.sorted_pairs,
        blocks.block_experts,
        blocks.num_blocks,
        row_scale if row_scale is not None else a,
        num_pairs,
        n,
        k,
        a_row_divisor,
        a.stride(0),
        weights.stride(0),
        weights.stride(1),
        weights.stride(2),
        out.stride(0),
        BLOCK_M=blocks.block_m,
        BLOCK_N=block_n,
        BLOCK_K=32,
        SCALE_ROWS=row_scale is not None,
        IEEE=a.dtype == torch.float32,
    )
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    activation,
) -> torch.Tensor:
    """x: [tokens, hidden]; w13: [E, 2I, hidden]; w2: [E, hidden, I]; weights, experts: [tokens, top_k]."""
    tokens, top_k = experts.shape
    blocks = align_to_experts(experts, w13.shape[0], block_m=16)
    num_pairs = tokens * top_k
    gate_up = _grouped_matmul(x, w13, blocks, num_pairs, top_k, None)
    down = _grouped_matmul(
        activation(gate_up), w2, blocks, num_pairs, 1, weights.flatten().to(x.dtype)
    )
    return down.view(tokens, top_k, -1).sum(dim=1)
