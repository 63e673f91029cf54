"""Engine options on the command line (DESIGN.md, command line), shared by `kubesgl serve`
and `kubesgl generate`. Each flag maps onto the EngineConfig field of the same name."""

from __future__ import annotations

import argparse

from kubesgl.engine.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig(model="")
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--tp-size", type=int, default=d.tp_size, help="tensor-parallel ranks")
    parser.add_argument("--role", choices=["mixed", "prefill", "decode"], default=d.role)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=d.dtype)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default=d.kv_cache_dtype,
                        help="storage of the KV cache: auto = the model's dtype; fp8_e4m3 halves its bytes")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default=d.load_format,
                        help="dummy: random weights from the config, no weight files read")
    parser.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    parser.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    parser.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                        help="prompt tokens per prefill step; 0 or less disables chunking")
    parser.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    parser.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens,
                        help="KV pool size in tokens (default: from free memory)")
    parser.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    parser.add_argument("--context-length", type=int, default=d.context_length)
    parser.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                        help="output limit of requests that give no max_tokens")
    parser.add_argument("--attention-backend", choices=["auto", "torch", "triton", "flashinfer"], default=d.attention_backend,
                        help="auto: flashinfer on CUDA where installed, else triton; torch on the CPU")
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs,
                        help="largest decode batch captured in a CUDA graph")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, tp_size=args.tp_size, role=args.role, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        load_format=args.load_format, page_size=args.page_size, max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.max_prefill_tokens,
        max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
        context_length=args.context_length, default_max_tokens=args.default_max_tokens,
        attention_backend=args.attention_backend,
        disable_radix_cache=args.disable_radix_cache, disable_overlap_schedule=args.disable_overlap_schedule,
        disable_cuda_graph=args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
    )
