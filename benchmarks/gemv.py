"""Batch-1 linear layers of the Llama-3.1-8B shape: cuBLAS (torch.nn.functional.linear)
against a plain Triton GEMV over a few tile shapes, as achieved bandwidth (weight bytes
over time; `triton.testing.do_bench` flushes the L2 between runs). The engine keeps cuBLAS:
on the H200 no tile shape of this kernel beat it by more than 2% (benchmarks/README.md).

    python benchmarks/gemv.py --out benchmarks/results/gemv_llama8b_h200.json
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import report


@triton.jit
def _gemv(
    X,
    W,
    Bias,
    Y,
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + cols) < K
        x = tl.load(X + k + cols, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(
            W + rows[:, None] * stride_w + (k + cols)[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_mask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int = 8,
    block_k: int = 512,
    num_warps: int = 4,
) -> torch.Tensor:
    """x: [1, K] (contiguous), weight: [N, K] -> [1, N]. Each program reduces BLOCK_N output
    features over the whole input, reading W in BLOCK_K-wide tiles (coalesced along K)."""
    n, k = weight.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return y


SHAPES = {
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (128256, 4096),
}
CONFIGS = [
    dict(block_n=n, block_k=k, num_warps=w)
    for n, k, w in itertools.product([2, 4, 8, 16], [256, 512, 1024], [4, 8])
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shapes": {},
    }
    for name, (n, k) in SHAPES.items():
        result["shapes"][name] = measure(n, k)
        best, cublas = result["shapes"][name]["best"], result["shapes"][name]["cublas_us"]
        print(
            f"{name}: cuBLAS {cublas:.1f} us, Triton best {best['us']:.1f} us ({best['tb_s']:.2f} TB/s) {best}",
            flush=True,
        )
    report(result, args.out)


def measure(n: int, k: int) -> dict:
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")

    def tb_s(ms: float) -> float:
        return w.numel() * 2 / (ms * 1e-3) / 1e12

    cublas = triton.testing.do_bench(lambda: F.linear(x, w))
    ref = F.linear(x, w).float()
    rows = []
    for config in CONFIGS:
        out = gemv(x, w, **config).float()
        error = ((out - ref).abs().max() / ref.abs().max()).item()
        ms = triton.testing.do_bench(lambda: gemv(x, w, **config))  # noqa: B023 - called before the loop moves on
        rows.append({**config, "us": ms * 1e3, "tb_s": tb_s(ms), "max_rel_error": error})
    best = min(rows, key=lambda r: r["us"])
    return {
        "n": n,
        "k": k,
        "cublas_us": cublas * 1e3,
        "cublas_tb_s": tb_s(cublas),
        "best": best,
        "configs": rows,
    }


if __name__ == "__main__":
    main()
