"""Residual add + RMS norm + the linear layer that reads the norm's output, in one kernel,
for decode-sized batches (up to MAX_ROWS rows).

At batch 1 a decode step is a chain of short kernels, and each pays a fixed ramp-up; the
norm before qkv_proj and gate_up_proj is one of them. Here every program computes
BLOCK_N output features of every row: it reads its rows first (a few KiB, from L2) for their
RMS, then streams its BLOCK_N rows of W once, normalising the input tile by tile in
registers, so the normed activations never go to memory and the norm's launch is gone.
Program 0 also writes the residual sum. Rounds where the norm kernel (norm.py) rounds, so
the linear layer sees the very values it sees after that kernel.

With programmatic dependent launch (Hopper and later, `launch_pdl`), a program loads its
first W tile (which no earlier kernel writes) before it waits for the previous kernel, so
its ramp-up overlaps that kernel's tail. Up to 4 rows the products run on CUDA cores; 5 to
16 rows go through tl.dot with the rows padded to 16.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16
# Triton's interpreter multiplies bfloat16 tiles wrongly in tl.dot (Triton 3.9): there the
# dot runs on the same values widened to float32, which a float32 accumulation makes equal.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_DOT_ROWS = 16  # tl.dot needs 16 rows at least


@dataclass(frozen=True)
class GemvTiles:
    """A program's tile: BLOCK_N output features, K read BLOCK_K at a time."""

    block_n: int
    block_k: int
    num_warps: int = 4


def default_tiles(rows: int) -> GemvTiles:
    """CUDA-core path: 8K float32 partial sums per program (BLOCK_M * BLOCK_N * BLOCK_K, 64
    registers a thread at 4 warps); tensor-core path: 16 x 32 x 128 tiles."""
    if rows > 4:
        return GemvTiles(block_n=32, block_k=128)
    return GemvTiles(block_n=16 // triton.next_power_of_2(rows), block_k=512)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs compute capability 9.0 and a real launch (not the
    interpreter)."""
    return (device.type == "cuda" and not _INTERPRETED and torch.cuda.get_device_capability(device)[0] >= 9)


@triton.jit
def _summed_tile(X, Residual, rows, cols, mask, stride_x, stride_r, HAS_RESIDUAL: tl.constexpr):
    """x + residual for a [BLOCK_M, BLOCK_K] tile, rounded to the model's dtype."""
    h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    return h


@triton.jit
def _norm_gemv(X, Residual, NormWeight, W, Bias, Y, SumOut, M, N, K, eps,
               stride_x, stride_r, stride_w, stride_y,
               HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, USE_DOT: tl.constexpr,
               DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               NORM_BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M).to(tl.int64)  # times a stride can pass 2**31
    row_mask = rows < M
    feats = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    feat_mask = feats < N
    kk = tl.arange(0, BLOCK_K)
    w_ptrs = W + feats[:, None].to(tl.int64) * stride_w + kk[None, :]
    # W is no earlier kernel's output: its first tile is in flight before the wait.
    w = tl.load(w_ptrs, mask=feat_mask[:, None] & (kk < K)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()

    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, NORM_BLOCK_K):
        cols = k0 + tl.arange(0, NORM_BLOCK_K)
        mask = row_mask[:, None] & (cols < K)[None, :]
        h = _summed_tile(X, Residual, rows, cols, mask, stride_x, stride_r, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            if pid == 0:
                tl.store(SumOut + rows[:, None] * K + cols[None, :], h, mask=mask)
        hf = h.to(tl.float32)
        sum_sq += tl.sum(hf * hf, axis=1)
    inv_rms = tl.rsqrt(sum_sq / K + eps)

    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # products summed over K once, after the loop: no cross-thread reduction per tile
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + kk
        k_mask = cols < K
        # the next tile is requested before this one is used: two tiles in flight per program
        w_next = tl.load(w_ptrs + k0 + BLOCK_K, mask=feat_mask[:, None] & (cols + BLOCK_K < K)[None, :], other=0.0)
        h = _summed_tile(X, Residual, rows, cols, row_mask[:, None] & k_mask[None, :], stride_x, stride_r,
                         HAS_RESIDUAL)
        normed = (h.to(tl.float32) * inv_rms[:, None]).to(h.dtype)
        gamma = tl.load(NormWeight + cols, mask=k_mask, other=0.0)
        a = (normed.to(tl.float32) * gamma.to(tl.float32)[None, :]).to(h.dtype)
        if USE_DOT:
            if DOT_FP32:
                acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w))
        else:
            acc += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w = w_next
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if USE_DOT:
        y = acc
    else:
        y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(Bias + feats, mask=feat_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + feats[None, :], y.to(Y.dtype.element_ty),
             mask=row_mask[:, None] & feat_mask[None, :])


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                    tiles: GemvTiles | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """linear(rms_norm(x + residual)) and the residual stream x + residual (x itself without
    a residual). x, residual: [M, K] with M <= MAX_ROWS; weight: [N, K]. `pdl` launches with
    programmatic dependent launch (see pdl_supported)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"rms_norm_linear takes at most {MAX_ROWS} rows, got {m}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm_linear needs rows contiguous in memory")
    tiles = tiles or default_tiles(m)
    use_dot = m > 4
    block_m = _DOT_ROWS if use_dot else triton.next_power_of_2(m)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else x
    if m == 0:
        return out, summed
    options = {"launch_pdl": True} if pdl else {}
    _norm_gemv[(triton.cdiv(n, tiles.block_n),)](
        x, residual if residual is not None else x, norm_weight, weight, bias if bias is not None else weight, out,
        summed, m, n, k, eps, x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        out.stride(0), HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, USE_PDL=pdl, USE_DOT=use_dot,
        DOT_FP32=x.dtype == torch.float32 or _INTERPRETED, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        NORM_BLOCK_K=min(triton.next_power_of_2(k), 8192 // block_m), num_warps=tiles.num_warps, **options)
    return out, summed
