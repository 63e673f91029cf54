"""Batch-1 linear layers of the Llama-3.1-8B shape as a decode step runs them: 32 calls of one
shape, each with its own weight (so nothing comes from the L2), captured in one CUDA graph,
under a choice of BLAS path: torch's default, `--blas cublas` or `cublaslt`
(`torch.backends.cuda.preferred_blas_library`), or `tunable` (TunableOp tunes each shape
eagerly first, then the graph replays its pick). Prints µs per call and the bandwidth the
weights stream at. One process per choice, as the library choice is process-wide. GPU only.

`--after-norm` puts the engine's RMS norm before each call, as a layer runs qkv_proj and
gate_up_proj, and `--kernel triton` times the engine's batch-1 GEMV kernel
(engine/layers/triton_kernels/gemv.py) instead of torch's linear, over a sweep of its rows
per program and warps, with and without programmatic dependent launch (with it, the GEMV
loads its weights while the norm before it runs).

    for blas in default cublas cublaslt tunable; do
      python benchmarks/gemv_in_graph.py --blas $blas --out gemv_in_graph_$blas.json
    done
    python benchmarks/gemv_in_graph.py --after-norm --out gemv_in_graph_norm_linear.json
    python benchmarks/gemv_in_graph.py --after-norm --kernel triton --out gemv_in_graph_norm_triton.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from common import report
from gemv import SHAPES  # the Llama-3.1-8B shapes, (out, in) features

from kubesgl.engine.layers.triton_kernels import gemv as gemv_module
from kubesgl.engine.layers.triton_kernels.norm import rms_norm

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def choose_blas(blas: str) -> None:
    if blas in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(blas)
    elif blas == "tunable":
        torch.cuda.tunable.enable(True)
        torch.cuda.tunable.tuning_enable(True)
        torch.cuda.tunable.set_filename(
            os.path.join(tempfile.gettempdir(), f"tunableop_{os.getpid()}.csv")
        )


def time_in_graph(
    n: int,
    k: int,
    calls: int,
    linear: Linear = F.linear,
    after_norm: bool = False,
    replays: int = 30,
) -> float:
    """µs per call of x[1, k] @ w[n, k].T over `calls` distinct weights in one graph (with
    `after_norm`, each call's input is the RMS norm of x, computed just before it)."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(calls)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.ones(k, device="cuda", dtype=torch.bfloat16)

    def layer(w: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(x, norm_weight, 1e-6) if after_norm else x, w)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up (compilation, TunableOp's tuning) outside the capture
        for w in weights:
            layer(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [layer(w) for w in weights]
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


def sweep_triton(n: int, k: int, calls: int, after_norm: bool) -> dict:
    """The Triton GEMV at each tile shape, then the best one again without PDL."""
    runs = []
    for block_n in (1, 2, 4, 8, 16):
        for warps in (4, 8):
            held_per_thread = block_n * triton.next_power_of_2(k) // (32 * warps)
            if held_per_thread > 256:  # registers would spill
                continue

            def linear(x, w, block_n=block_n, warps=warps):
                return gemv_module.gemv(x, w, block_n=block_n, num_warps=warps)

            us = time_in_graph(n, k, calls, linear, after_norm)
            runs.append({"block_n": block_n, "num_warps": warps, "pdl": True, "us_per_call": us})
    best = min(runs, key=lambda run: run["us_per_call"])
    launch = gemv_module.pdl_launch
    gemv_module.pdl_launch = lambda device: {"USE_PDL": False}  # the same kernel launched plainly
    try:
        plain = time_in_graph(
            n,
            k,
            calls,
            lambda x, w: gemv_module.gemv(
                x, w, block_n=best["block_n"], num_warps=best["num_warps"]
            ),
            after_norm,
        )
    finally:
        gemv_module.pdl_launch = launch
    runs.append({**best, "pdl": False, "us_per_call": plain})
    default_block_n, default_warps = gemv_module.gemv_block_rows(k)
    return {
        "n": n,
        "k": k,
        "us_per_call": best["us_per_call"],
        "tb_s": n * k * 2 / best["us_per_call"] / 1e6,
        "best": best,
        "engine_default": {"block_n": default_block_n, "num_warps": default_warps},
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--blas", choices=("default", "cublas", "cublaslt", "tunable"), default="default"
    )
    parser.add_argument("--kernel", choices=("linear", "triton"), default="linear")
    parser.add_argument("--after-norm", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    choose_blas(args.blas)
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "blas": args.blas,
        "kernel": args.kernel,
        "after_norm": args.after_norm,
        "shapes": {},
    }
    for name, (n, k) in SHAPES.items():
        calls = 4 if name == "lm_head" else 32
        if args.kernel == "linear":
            us = time_in_graph(n, k, calls, after_norm=args.after_norm)
            result["shapes"][name] = {
                "n": n,
                "k": k,
                "us_per_call": us,
                "tb_s": n * k * 2 / us / 1e6,
            }
        else:
            result["shapes"][name] = sweep_triton(n, k, calls, args.after_norm)
        print(name, result["shapes"][name]["us_per_call"], flush=True)
    if args.blas == "tunable":
        result["tunable_picks"] = [list(map(str, row)) for row in torch.cuda.tunable.get_results()]
    report(result, args.out)


if __name__ == "__main__":
    main()
