"""Shared-prefix workload offline, with and without the radix cache: many questions behind a
few long system prompts (the GPU issue's goal: at least 3x the throughput with the cache),
the cached runs once per --schedule-policies entry (the waiting queue's order).

    python benchmarks/shared_prefix.py --model benchmarks/models/llama-3.1-8b --load-format dummy \
        --out benchmarks/results/shared_prefix_llama8b.json

The order only matters once the pool cannot keep every system prompt: more groups, a
smaller pool, e.g. `--groups 64 --system-len 4096 --max-total-tokens 131072
--schedule-policies fcfs,lpm,dfs-weight`.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import engine_parser, make_llm, report

from kubesgl.bench.datasets import shared_prefix_requests
from kubesgl.engine import SamplingParams


def run(args: argparse.Namespace, radix: bool, policy: str) -> dict:
    llm = make_llm(
        args,
        disable_radix_cache=not radix,
        schedule_policy=policy,
        context_length=args.system_len + args.question_len + args.output_len + 16,
    )
    vocab = llm.engine.model_config.vocab_size
    requests = shared_prefix_requests(
        args.num_prompts,
        args.groups,
        args.system_len,
        args.question_len,
        args.output_len,
        vocab,
        random.Random(0),
    )
    llm.generate(
        [r.prompt for r in requests[:2]], SamplingParams(max_tokens=2, ignore_eos=True)
    )  # warm up
    llm.engine.scheduler.reset()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(
        [r.prompt for r in requests],
        SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True),
    )
    elapsed = time.perf_counter() - start
    stats = llm.engine.scheduler.stats()
    llm.shutdown()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "radix_cache": radix,
        "schedule_policy": policy,
        "seconds": elapsed,
        "retractions": stats.retractions,
        "output_tokens_per_s": sum(len(o.token_ids) for o in outputs) / elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "prefix_hit_ratio": stats.cached_prompt_tokens / max(stats.prompt_tokens, 1),
    }


def main() -> None:
    parser = engine_parser(__doc__, dtype="bfloat16", attention_backend="triton")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--schedule-policies",
        default="fcfs",
        help="comma-separated --schedule-policy values, one cached run each (the first is "
        "the one the speedup compares)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    policies = args.schedule_policies.split(",")
    by_policy = {policy: run(args, True, policy) for policy in policies}
    with_cache, without = by_policy[policies[0]], run(args, False, "fcfs")
    result = {
        "config": vars(args),
        "with_radix_cache": with_cache,
        "without_radix_cache": without,
        "by_schedule_policy": by_policy,
        "speedup": with_cache["output_tokens_per_s"] / without["output_tokens_per_s"],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
