"""Decode attention of the Llama-3.1-8B shape (32 query heads, 8 KV heads, head size 128): KV
in bf16 or, with --kv-dtype fp8_e4m3, FP8, in pages of --page-size tokens (the engine's
default is 1) scattered over the pool. FlashInfer's tensor-core decode (the engine's choice),
its CUDA-core decode, the tensor-core decode without split KV, and kubesgl's Triton kernel
(with the splits it picks for the batch, and with 8), per batch size and context length.
Each variant is captured in one CUDA graph of 32 calls, one per layer of the KV pool (so
nothing is served from the L2), and timed over replays; the figure is µs per call, next to
the time the KV bytes take at the device's copy bandwidth.

    python benchmarks/decode_attention.py --out benchmarks/results/decode_attention_h200.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
from common import report
from decode_latency import copy_bandwidth

from kubesgl.engine.attention.triton_kernels.decode import decode_attention

HEADS, KV_HEADS, DIM, LAYERS = 32, 8, 128, 32
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
VARIANTS = (
    "flashinfer_tensor_cores",
    "flashinfer_cuda_cores",
    "flashinfer_tensor_cores_no_split",
    "triton",
    "triton_8_splits",
)


def graph_of(calls: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`calls` captured on a side stream (as PyTorch's capture wants), after a warm-up (JIT,
    autotuning) outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        calls()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """µs per replay of `graph`, median over `replays`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def time_graph(calls: Callable[[], None]) -> float:
    """µs per replay of a CUDA graph of `calls` (median)."""
    return replay_us(graph_of(calls))


@dataclass
class Buffers:
    k_pool: torch.Tensor  # [LAYERS, slots, KV_HEADS, DIM]
    v_pool: torch.Tensor
    workspace: torch.Tensor  # FlashInfer's scratch space
    graph_indices: torch.Tensor  # FlashInfer's fixed buffer of KV pages: room for every slot

    @classmethod
    def allocate(cls, slots: int, device: torch.device, kv_dtype: torch.dtype) -> Buffers:
        def pool() -> torch.Tensor:  # a layer at a time: float32 noise for all would not fit
            layers = torch.empty(LAYERS, slots, KV_HEADS, DIM, dtype=kv_dtype, device=device)
            for layer in layers:
                layer.copy_(torch.randn(layer.shape, device=device))
            return layers

        return cls(
            pool(),
            pool(),
            torch.zeros(256 << 20, dtype=torch.uint8, device=device),
            torch.zeros(slots, dtype=torch.int32, device=device),
        )


def measure(names: list[str], buffers: Buffers, batch: int, context: int, page: int) -> dict:
    """µs per decode-attention call of each variant, for `batch` requests of `context` tokens
    in pages of `page` tokens."""
    import flashinfer

    k_pool, v_pool = buffers.k_pool, buffers.v_pool
    device, num_pages = k_pool.device, k_pool.shape[1] // page
    dtype, kv_dtype = torch.bfloat16, k_pool.dtype
    q = torch.randn(batch, HEADS, DIM, dtype=dtype, device=device)
    out = torch.empty_like(q)
    # each request's pages scattered over the pool, as after many steps of allocation
    pages_per_request = context // page
    indices = torch.randperm(num_pages - 1, device=device)[: batch * pages_per_request].int() + 1
    indptr = torch.arange(0, len(indices) + 1, pages_per_request, dtype=torch.int32)
    last_page_len = torch.full((batch,), page, dtype=torch.int32)
    paged = [
        (k.view(-1, page, KV_HEADS, DIM), v.view(-1, page, KV_HEADS, DIM))
        for k, v in zip(k_pool, v_pool)
    ]

    def flashinfer_variant(tensor_cores: bool, **plan) -> Callable[[], None]:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            buffers.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=indptr.to(device),
            paged_kv_indices_buffer=buffers.graph_indices,
            paged_kv_last_page_len_buffer=last_page_len.to(device),
        )
        wrapper.plan(
            indptr, indices, last_page_len, HEADS, KV_HEADS, DIM, page,
            q_data_type=dtype, kv_data_type=kv_dtype, sm_scale=DIM**-0.5, **plan,
        )  # fmt: skip

        def calls() -> None:
            for i in range(LAYERS):
                wrapper.run(q, paged[i], out=out)

        return calls

    slots = indices.long()[:, None] * page + torch.arange(page, device=device)
    table = slots.view(batch, context)
    req_rows = torch.arange(batch, device=device)
    seq_lens = torch.full((batch,), context, device=device)

    def triton_variant(num_splits: int | None) -> Callable[[], None]:
        def calls() -> None:
            for i in range(LAYERS):
                decode_attention(
                    q, k_pool[i], v_pool[i], table, req_rows, seq_lens, DIM**-0.5, None,
                    num_splits=num_splits, out=out,
                )  # fmt: skip

        return calls

    variants: dict[str, Callable[[], Callable[[], None]]] = {  # each planned just before it runs
        "flashinfer_tensor_cores": lambda: flashinfer_variant(True),
        "flashinfer_cuda_cores": lambda: flashinfer_variant(False),
        "flashinfer_tensor_cores_no_split": lambda: flashinfer_variant(True, disable_split_kv=True),
        "triton": lambda: triton_variant(None),  # the engine's choice of splits
        "triton_8_splits": lambda: triton_variant(8),
    }
    return {f"{name}_us": time_graph(variants[name]()) / LAYERS for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bf16")
    parser.add_argument("--page-size", type=int, default=1, help="tokens per KV page")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    names = args.variants.split(",")
    if unknown := set(names) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    device, kv_dtype = torch.device("cuda"), KV_DTYPES[args.kv_dtype]
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if any(context % args.page_size for context in contexts):
        parser.error("every context must be a whole number of pages")
    slots = max(batches) * max(contexts) + args.page_size  # + the padding page
    buffers = Buffers.allocate(slots, device, kv_dtype)
    bandwidth = copy_bandwidth(device)
    rows = []
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * KV_HEADS * DIM * kv_dtype.itemsize  # one layer
            row = {"batch": batch, "context": context, "kv_bytes_us": kv_bytes / bandwidth * 1e6}
            row.update(measure(names, buffers, batch, context, args.page_size))
            print(row, flush=True)
            rows.append(row)
    gpu = torch.cuda.get_device_name(device)
    report(
        {
            "gpu": gpu,
            "kv_dtype": args.kv_dtype,
            "page_size": args.page_size,
            "copy_bandwidth_tb_s": bandwidth / 1e12,
            "rows": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
