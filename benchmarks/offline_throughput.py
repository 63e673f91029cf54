"""Offline throughput: N random prompts of a fixed length, fixed output length with
ignore_eos, all given to `LLM.generate` at once (the shape of SGLang's offline benchmark).

    python benchmarks/offline_throughput.py --model benchmarks/models/llama-3.1-8b --load-format dummy \
        --num-prompts 200 --input-len 1024 --output-len 512 --out benchmarks/results/offline_200_1024_512.json
"""

from __future__ import annotations

import random
import time

import torch
from common import engine_facts, engine_parser, make_llm, report

from kubesgl.engine import SamplingParams


def main() -> None:
    parser = engine_parser(__doc__, dtype="bfloat16", attention_backend="triton")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = make_llm(args, context_length=args.input_len + args.output_len + 16)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, vocab - 10) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    llm.engine.scheduler.reset()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(
        prompts, SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    )
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == args.output_len for o in outputs)
    result = {
        **engine_facts(args, llm),
        "kv_cache_dtype": args.kv_cache_dtype,
        "cuda_graph": not args.disable_cuda_graph,
        "enable_mixed_chunk": args.enable_mixed_chunk,
        "chunked_prefill_size": args.chunked_prefill_size,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_running_requests": args.max_running_requests,
        "kv_pool_tokens": llm.engine.scheduler.stats().kv_total_tokens,
        "retractions": llm.engine.scheduler.stats().retractions,
        "seconds": elapsed,
        "output_tokens_per_s": args.num_prompts * args.output_len / elapsed,
        "total_tokens_per_s": args.num_prompts * (args.input_len + args.output_len) / elapsed,
    }
    llm.shutdown()
    report(result, args.out)


if __name__ == "__main__":
    main()
