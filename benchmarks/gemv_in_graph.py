"""Batch-1 linear layers of the Llama-3.1-8B shape as a decode step runs them: 32 calls of one
shape, each with its own weight (so nothing comes from the L2), captured in one CUDA graph,
under a choice of BLAS path: torch's default, `--blas cublas` or `cublaslt`
(`torch.backends.cuda.preferred_blas_library`), or `tunable` (TunableOp tunes each shape
eagerly first, then the graph replays its pick). Prints µs per call and the bandwidth the
weights stream at. One process per choice, as the library choice is process-wide. GPU only.

    for blas in default cublas cublaslt tunable; do
      python benchmarks/gemv_in_graph.py --blas $blas --out gemv_in_graph_$blas.json
    done
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from common import report
from gemv import SHAPES  # the Llama-3.1-8B shapes, (out, in) features


def choose_blas(blas: str) -> None:
    if blas in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(blas)
    elif blas == "tunable":
        torch.cuda.tunable.enable(True)
        torch.cuda.tunable.tuning_enable(True)
        torch.cuda.tunable.set_filename(
            os.path.join(tempfile.gettempdir(), f"tunableop_{os.getpid()}.csv")
        )


def time_in_graph(n: int, k: int, calls: int, replays: int = 30) -> float:
    """µs per call of x[1, k] @ w[n, k].T over `calls` distinct weights in one graph."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(calls)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up (and TunableOp's tuning) outside the capture
        for w in weights:
            F.linear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [F.linear(x, w) for w in weights]
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del outputs, graph, weights
    torch.cuda.empty_cache()
    return start.elapsed_time(end) * 1000 / replays / calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--blas", choices=("default", "cublas", "cublaslt", "tunable"), default="default"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    choose_blas(args.blas)
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "blas": args.blas,
        "shapes": {},
    }
    for name, (n, k) in SHAPES.items():
        us = time_in_graph(n, k, calls=4 if name == "lm_head" else 32)
        result["shapes"][name] = {"n": n, "k": k, "us_per_call": us, "tb_s": n * k * 2 / us / 1e6}
    if args.blas == "tunable":
        result["tunable_picks"] = [list(map(str, row)) for row in torch.cuda.tunable.get_results()]
    report(result, args.out)


if __name__ == "__main__":
    main()
