"""The norm before qkv_proj and gate_up_proj, fused into the linear layer's kernel, against
today's pair (fused residual add + RMS norm, then cuBLAS) and cuBLAS alone, at decode batch
sizes on the Llama-3.1-8B shape.

Each case is timed as a decode step runs it: a CUDA graph of 32 layers, each layer the
cuBLAS GEMV that precedes the norm in the model (down_proj before qkv_proj, o_proj before
gate_up_proj) and then the variant, every layer with its own weights (so they stream from
HBM), the L2 flushed before each replay. A variant's cost per layer is the graph's time over
32 minus that of the predecessors alone. `fused+pdl` launches with programmatic dependent
launch: its first weight tile loads while the predecessor finishes.

    python benchmarks/fused_norm_gemv.py --out benchmarks/results/fused_norm_gemv_h200.json

On a machine without a GPU, `--device cpu` runs tiny shapes through Triton's interpreter
(TRITON_INTERPRET=1), timed eagerly: a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
from common import report

from kubesgl.engine.layers.triton_kernels.norm import rms_norm
from kubesgl.engine.layers.triton_kernels.norm_gemv import (
    GemvTiles,
    default_tiles,
    pdl_supported,
    rms_norm_linear,
)

HIDDEN = 4096
# fused layer: (N, K); the GEMV before its norm: (N, K)
CASES = {"qkv_proj": ((6144, HIDDEN), (HIDDEN, 14336)), "gate_up_proj": ((28672, HIDDEN), (HIDDEN, HIDDEN))}
SWEEP = {
    1: [GemvTiles(8, 512), GemvTiles(16, 512), GemvTiles(32, 256), GemvTiles(8, 1024, 8), GemvTiles(16, 1024, 8)],
    4: [GemvTiles(2, 1024), GemvTiles(4, 512), GemvTiles(8, 256), GemvTiles(4, 1024, 8)],
    16: [GemvTiles(32, 128), GemvTiles(16, 256), GemvTiles(64, 128), GemvTiles(32, 256, 8)],
}
EPS = 1e-5


@dataclass
class Layers:
    """Per-layer inputs and weights of one case, as the model holds them."""

    x: torch.Tensor
    residual: torch.Tensor
    pred_in: torch.Tensor
    pred_weights: list[torch.Tensor]
    norm_weights: list[torch.Tensor]
    weights: list[torch.Tensor]


def make_layers(n: int, k: int, pred: tuple[int, int], rows: int, layers: int, device: torch.device) -> Layers:
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16) * scale

    return Layers(x=rand(rows, k), residual=rand(rows, k), pred_in=rand(rows, pred[1]),
                  pred_weights=[rand(*pred, scale=pred[1] ** -0.5) for _ in range(layers)],
                  norm_weights=[rand(k) * 0.1 + 1 for _ in range(layers)],
                  weights=[rand(n, k, scale=k**-0.5) for _ in range(layers)])


def variants(rows: int, pdl: bool) -> dict[str, Callable | None]:
    """name -> step(layers, i), what layer i runs after its predecessor GEMV (None: nothing)."""

    def norm_then_cublas(ls: Layers, i: int):
        normed, _ = rms_norm(ls.x, ls.norm_weights[i], EPS, ls.residual)
        return F.linear(normed, ls.weights[i])

    def fused(tiles: GemvTiles | None, with_pdl: bool):
        return lambda ls, i: rms_norm_linear(ls.x, ls.norm_weights[i], EPS, ls.weights[i], residual=ls.residual,
                                             tiles=tiles, pdl=with_pdl)[0]

    table = {"predecessor_only": None, "cublas_only": lambda ls, i: F.linear(ls.x, ls.weights[i]),
             "norm+cublas": norm_then_cublas, "fused": fused(None, False)}
    if pdl:
        table["fused+pdl"] = fused(None, True)
    for tiles in SWEEP.get(rows, []):
        if tiles != default_tiles(rows):
            table[f"fused {tiles.block_n}x{tiles.block_k}w{tiles.num_warps}"] = fused(tiles, False)
    return table


def chain(ls: Layers, step: Callable | None, layers: int) -> Callable[[], None]:
    def run():
        for i in range(layers):
            F.linear(ls.pred_in, ls.pred_weights[i])
            if step is not None:
                step(ls, i)
    return run


def timed(run: Callable[[], None], device: torch.device, flush: torch.Tensor, reps: int) -> float:
    """Median microseconds of one run, replayed from a CUDA graph with the L2 flushed before."""
    run()  # compiles the Triton kernels before capture
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def max_rel_error(ls: Layers) -> float:
    """The fused kernel against today's pair, on layer 0."""
    normed, _ = rms_norm(ls.x, ls.norm_weights[0], EPS, ls.residual)
    ref = F.linear(normed, ls.weights[0]).float()
    out = rms_norm_linear(ls.x, ls.norm_weights[0], EPS, ls.weights[0], residual=ls.residual)[0].float()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    cases, layers = CASES, args.layers
    if device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        cases = {name: ((n // 64, k // 64), (pn // 64, pk // 64)) for name, ((n, k), (pn, pk)) in CASES.items()}
        layers = min(layers, 2)
    pdl = pdl_supported(device)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    result = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "torch": torch.__version__,
              "triton": triton.__version__, "layers": layers, "pdl": pdl, "cases": [],
              "fused_max_rel_error": {}}
    print(f"{'layer':<13}{'batch':>6}  {'variant':<22}{'us/layer':>9}{'vs norm+cublas':>16}", flush=True)
    for name, ((n, k), pred) in cases.items():
        for rows in args.batches:
            ls = make_layers(n, k, pred, rows, layers, device)
            total = {}
            for variant, step in variants(rows, pdl).items():
                try:
                    total[variant] = timed(chain(ls, step, layers), device, flush, args.reps)
                except Exception as e:  # a variant this Triton or driver cannot launch is reported, not fatal
                    result["cases"].append({"layer": name, "batch": rows, "variant": variant, "error": repr(e)})
                    print(f"{name:<13}{rows:>6}  {variant:<22} failed: {e!r}", flush=True)
            base = total.pop("predecessor_only")
            pair = total["norm+cublas"] - base
            for variant, us in total.items():
                per_layer = (us - base) / layers
                row = {"layer": name, "n": n, "k": k, "batch": rows, "variant": variant, "us_per_layer": per_layer,
                       "saved_us_per_layer": pair / layers - per_layer,
                       "weight_tb_s": n * k * 2 / (per_layer * 1e-6) / 1e12 if per_layer > 0 else None}
                result["cases"].append(row)
                print(f"{name:<13}{rows:>6}  {variant:<22}{per_layer:>9.2f}{row['saved_us_per_layer']:>+16.2f}",
                      flush=True)
            result["fused_max_rel_error"][f"{name} batch {rows}"] = max_rel_error(ls)
            del ls
    report(result, args.out)


if __name__ == "__main__":
    main()
