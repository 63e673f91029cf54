"""Attention of one prefill chunk over its request's cached prefix, the Llama-3.1-8B shape
(as in decode_attention.py: bf16 KV in pages of one token, 32 calls in one CUDA graph, one
per layer of the pool), per chunk length and prefix length:

- `split_as_planned`: FlashInfer's paged prefill kernel as FlashInfer plans it (it splits
  the KV when the chunk's tiles leave multiprocessors idle, then merges the parts in a second
  kernel), and `no_split`: the same without split KV;
- with `--decodes NxC`, N decode requests of C tokens ride along, as in a mixed step:
  `two_calls` (the chunk through the prefill kernel, the decodes through the tensor-core
  decode kernel) and `one_call` (every row through one prefill call), each prefill planned
  as the engine plans it (`prefill_splits_kv`). The engine takes one call where every
  request holds at most `ONE_PASS_MIXED_MAX_KV` tokens.

Each figure is µs per layer: `_us` on the device (CUDA graph replays), `_host_us` the host's
time to launch the layer's calls eagerly, which is what a piecewise-graph step pays between
its pieces.

    python benchmarks/chunk_attention.py --out benchmarks/results/chunk_attention_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import report
from decode_attention import DIM, HEADS, KV_HEADS, LAYERS, Buffers, time_graph

from kubesgl.engine.attention.flashinfer_backend import prefill_splits_kv


def host_us(calls: Callable[[], None], repeats: int = 20) -> float:
    """Host µs to launch `calls` eagerly (per repeat, median), the device drained between."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        calls()
        times.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(times)


def measure(buffers: Buffers, chunk: int, prefix: int, decodes: int, decode_context: int) -> dict:
    import flashinfer

    k_pool, v_pool = buffers.k_pool, buffers.v_pool
    device, dtype, slots = k_pool.device, k_pool.dtype, k_pool.shape[1]
    kv = [(k_pool[i], v_pool[i]) for i in range(LAYERS)]
    seq_lens = [prefix + chunk] + [decode_context] * decodes
    new_lens = [chunk] + [1] * decodes
    indices = torch.randperm(slots - 1, device=device)[: sum(seq_lens)].int() + 1
    q = torch.randn(sum(new_lens), HEADS, DIM, dtype=dtype, device=device)
    out = torch.empty_like(q)

    def indptr(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def prefill(rows: slice, **plan) -> Callable[[int], None]:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            buffers.workspace, "NHD", backend="fa2"
        )
        kv_indptr = indptr(seq_lens[rows])
        first = int(indptr(seq_lens)[rows.start or 0])
        wrapper.plan(
            indptr(new_lens[rows]), kv_indptr, indices[first : first + int(kv_indptr[-1])],
            torch.ones(len(seq_lens[rows]), dtype=torch.int32), HEADS, KV_HEADS, DIM, 1,
            causal=True, sm_scale=DIM**-0.5, q_data_type=dtype, kv_data_type=dtype, **plan,
        )  # fmt: skip
        tokens = slice(sum(new_lens[: rows.start or 0]), sum(new_lens[: rows.stop]))
        return lambda i: wrapper.run(q[tokens], kv[i], out=out[tokens])

    def decode(rows: slice) -> Callable[[int], None]:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            buffers.workspace, "NHD", use_tensor_cores=True
        )
        kv_indptr = indptr(seq_lens[rows])
        first = int(indptr(seq_lens)[rows.start])
        wrapper.plan(
            kv_indptr, indices[first : first + int(kv_indptr[-1])],
            torch.ones(len(seq_lens[rows]), dtype=torch.int32), HEADS, KV_HEADS, DIM, 1,
            q_data_type=dtype, kv_data_type=dtype, sm_scale=DIM**-0.5,
        )  # fmt: skip
        return lambda i: wrapper.run(q[chunk:], kv[i], out=out[chunk:])

    def layers(*per_layer: Callable[[int], None]) -> Callable[[], None]:
        def calls() -> None:
            for i in range(LAYERS):
                for call in per_layer:
                    call(i)

        return calls

    def as_engine(rows: slice) -> dict:
        return {"disable_split_kv": not prefill_splits_kv(seq_lens[rows], new_lens[rows])}

    everything, chunk_row = slice(0, len(seq_lens)), slice(0, 1)
    if decodes:
        variants = {
            "two_calls": lambda: layers(
                prefill(chunk_row, **as_engine(chunk_row)), decode(slice(1, len(seq_lens)))
            ),
            "one_call": lambda: layers(prefill(everything, **as_engine(everything))),
        }
    else:
        variants = {
            "split_as_planned": lambda: layers(prefill(chunk_row)),
            "no_split": lambda: layers(prefill(chunk_row, disable_split_kv=True)),
        }
    row = {}
    for name, make in variants.items():  # each planned just before it runs
        calls = make()
        row[f"{name}_us"] = time_graph(calls) / LAYERS
        row[f"{name}_host_us"] = host_us(calls) / LAYERS
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", default="256,512,2048")
    parser.add_argument("--prefixes", default="0,1024,4096,16384")
    parser.add_argument(
        "--decodes", default="0x0", help="NxC,...: N decodes of C tokens beside the chunk"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    chunks = [int(c) for c in args.chunks.split(",")]
    prefixes = [int(p) for p in args.prefixes.split(",")]
    decode_sets = [tuple(int(x) for x in d.split("x")) for d in args.decodes.split(",")]
    slots = max(chunks) + max(prefixes) + max(n * c for n, c in decode_sets) + 1
    buffers = Buffers.allocate(slots, device, dtype)
    rows = []
    for decodes, decode_context in decode_sets:
        for chunk in chunks:
            for prefix in prefixes:
                row = {"chunk": chunk, "prefix": prefix, "decodes": decodes}
                row |= {"decode_context": decode_context}
                row |= measure(buffers, chunk, prefix, decodes, decode_context)
                print(row, flush=True)
                rows.append(row)
    report({"gpu": torch.cuda.get_device_name(device), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
