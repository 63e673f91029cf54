"""Can a prompt's matrix products hide under the decode steps' attention? The question behind
the offline bf16 figure, whose serial bound (decode attention + prompts + weight reads, one
after another) is under the scheduler issue's goal. A decode step of B requests of C tokens
(Llama-3.1-8B shape: bf16 KV in pages of --page-size, FlashInfer's tensor-core decode, and
each layer's four projections at M = B) is memory bound; a prompt chunk of M tokens through
the same projections is compute bound. Per (B, C, M), µs for all 32 layers, each a CUDA graph:

- `decode_us`: the decode step alone; `chunk_us`: the chunk's projections alone;
- `mixed_us`: one stream, the projections at M = B + chunk then the decode attention (how a
  mixed step runs today, less the chunk's own attention);
- `two_streams_us`: the decode step's graph and the chunk's graph replayed at once on two
  streams, from the first start to the last end.

`hidden` is the share of `chunk_us` that two streams hide against `mixed_us`. Weights and KV
cycle through --distinct-layers copies, each far larger than the L2, so nothing is served
from it.

    python benchmarks/stream_overlap.py --out benchmarks/results/stream_overlap_h200.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from common import report
from decode_attention import DIM, HEADS, KV_HEADS, LAYERS, graph_of, replay_us
from decode_latency import copy_bandwidth

HIDDEN, INTERMEDIATE = HEADS * DIM, 14336
# one layer's projections as (input features, output features): qkv, o, gate_up, down
PROJECTIONS = ((HIDDEN, (HEADS + 2 * KV_HEADS) * DIM), (HIDDEN, HIDDEN),
               (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN))  # fmt: skip


def projections(weights: list[list[torch.Tensor]], rows: int) -> Callable[[], None]:
    """All layers' projections for `rows` tokens (their inputs reused: only the time counts)."""
    device = weights[0][0].device
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16, device=device) for k, _ in PROJECTIONS}

    def calls() -> None:
        for i in range(LAYERS):
            for (k, _), w in zip(PROJECTIONS, weights[i % len(weights)]):
                torch.nn.functional.linear(inputs[k], w)

    return calls


def decode_attention(kv: list[torch.Tensor], batch: int, context: int, page: int):
    """All layers' decode attention for `batch` requests of `context` tokens, pages scattered."""
    import flashinfer

    device = kv[0].device
    num_pages = kv[0].shape[0]  # [pages, 2 (K and V), page, KV heads, head size]
    per_request = context // page
    indices = torch.randperm(num_pages, device=device)[: batch * per_request].int()
    indptr = torch.arange(0, len(indices) + 1, per_request, dtype=torch.int32)
    last_page_len = torch.full((batch,), page, dtype=torch.int32)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device=device), "NHD",
        use_cuda_graph=True, use_tensor_cores=True,
        paged_kv_indptr_buffer=indptr.to(device), paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=last_page_len.to(device),
    )  # fmt: skip
    wrapper.plan(
        indptr, indices.cpu(), last_page_len, HEADS, KV_HEADS, DIM, page,
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=DIM**-0.5,
    )  # fmt: skip
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)

    def calls() -> None:
        for i in range(LAYERS):
            wrapper.run(q, kv[i % len(kv)], out=out)

    return calls


def time_together(first: torch.cuda.CUDAGraph, second: torch.cuda.CUDAGraph, replays: int = 20):
    """µs from the start of two graphs replayed on two streams to the end of both (median)."""
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        for stream, graph in zip(streams, (first, second)):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                graph.replay()
            torch.cuda.current_stream().wait_stream(stream)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decodes", default="64x4096,160x5120", help="BATCHxCONTEXT, ...")
    parser.add_argument("--chunks", default="128,256,512,1024,2048", help="prompt tokens")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--distinct-layers", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    decodes = [tuple(int(x) for x in d.split("x")) for d in args.decodes.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    device, page = torch.device("cuda"), args.page_size
    weights = [
        [torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5 for k, n in PROJECTIONS]
        for _ in range(args.distinct_layers)
    ]
    pages = max(b * c for b, c in decodes) // page
    kv = [
        torch.randn(pages, 2, page, KV_HEADS, DIM, dtype=torch.bfloat16, device=device)
        for _ in range(args.distinct_layers)
    ]
    rows = []
    for batch, context in decodes:
        attention = decode_attention(kv, batch, context, page)
        decode_projections = projections(weights, batch)

        def decode_step(attention=attention, decode_projections=decode_projections) -> None:
            decode_projections()
            attention()

        decode_graph = graph_of(decode_step)
        decode_us = replay_us(decode_graph)
        for chunk in chunks:
            chunk_graph = graph_of(projections(weights, chunk))
            mixed_projections = projections(weights, batch + chunk)

            def mixed_step(mixed_projections=mixed_projections, attention=attention) -> None:
                mixed_projections()
                attention()

            row = {
                "batch": batch,
                "context": context,
                "chunk": chunk,
                "decode_us": decode_us,
                "chunk_us": replay_us(chunk_graph),
                "mixed_us": replay_us(graph_of(mixed_step)),
                "two_streams_us": time_together(decode_graph, chunk_graph),
            }
            row["hidden"] = (row["mixed_us"] - row["two_streams_us"]) / row["chunk_us"]
            print(row, flush=True)
            rows.append(row)
    report(
        {
            "gpu": torch.cuda.get_device_name(device),
            "page_size": page,
            "copy_bandwidth_tb_s": copy_bandwidth(device) / 1e12,
            "rows": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
