"""Offline throughput: N prompts of random tokens, each run to its output length with
ignore_eos, all given to `LLM.generate` at once (the shape of SGLang's offline benchmark).
Lengths are fixed by default; `--random-range-ratio R` draws each prompt's input length
uniformly from [max(1, R x input-len), input-len] and its output length from
[max(1, R x output-len), output-len], as SGLang's random dataset does (its CI's offline bar
runs R = 0; SGLang allows an output of 0 tokens there, this engine needs at least 1).
Beside the throughput, where the time went: the wall time of the engine's steps by kind
(decode, extend, mixed), their count and mean batch size (`steps`). With overlap, a step's
time is taken as that of the engine turn that waited for it.

    python benchmarks/offline_throughput.py --model benchmarks/models/llama-3.1-8b --load-format dummy \
        --num-prompts 200 --input-len 1024 --output-len 512 --out benchmarks/results/offline_200_1024_512.json
"""

from __future__ import annotations

import random
import time
from collections import defaultdict

import torch
from common import engine_facts, engine_parser, make_llm, report

from kubesgl.cli_help import fraction
from kubesgl.engine import SamplingParams


class StepTimeline:
    """Where an engine's time goes: each step is charged the time from the previous step's
    results to its own (the device's time for it, when the host keeps up), by kind."""

    def __init__(self, scheduler):
        self._process = scheduler._process  # a benchmark may look inside: it times each step
        scheduler._process = self._timed
        self._last = time.perf_counter()
        self.seconds: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.rows: dict[str, int] = defaultdict(int)

    def _timed(self, batch, future):
        outputs = self._process(batch, future)
        now = time.perf_counter()
        kind = batch.mode.name.lower()
        self.seconds[kind] += now - self._last
        self.count[kind] += 1
        self.rows[kind] += len(batch.reqs)
        self._last = now
        return outputs

    def summary(self) -> dict:
        return {
            kind: {
                "steps": self.count[kind],
                "seconds": self.seconds[kind],
                "mean_batch": self.rows[kind] / self.count[kind],
            }
            for kind in sorted(self.count)
        }


def draw_lengths(rng: random.Random, count: int, longest: int, range_ratio: float) -> list[int]:
    """`count` lengths drawn uniformly from [max(1, range_ratio x longest), longest]."""
    shortest = max(1, int(longest * range_ratio))
    return [rng.randint(shortest, longest) for _ in range(count)]


def main() -> None:
    parser = engine_parser(__doc__, dtype="bfloat16", attention_backend="triton")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument(
        "--random-range-ratio",
        type=fraction,
        default=1.0,
        help="lengths drawn from [ratio x length, length] (SGLang's meaning); 1: fixed lengths",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lengths_rng = random.Random(1)  # its own stream: fixed lengths keep the prompts of before
    input_lens = draw_lengths(
        lengths_rng, args.num_prompts, args.input_len, args.random_range_ratio
    )
    output_lens = draw_lengths(
        lengths_rng, args.num_prompts, args.output_len, args.random_range_ratio
    )
    llm = make_llm(args, context_length=args.input_len + args.output_len + 16)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in input_lens]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    llm.engine.scheduler.reset()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timeline = StepTimeline(llm.engine.scheduler)
    start = time.perf_counter()
    outputs = llm.generate(
        prompts,
        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in output_lens],
    )
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == output_lens
    result = {
        **engine_facts(args, llm),
        "kv_cache_dtype": args.kv_cache_dtype,
        "page_size": args.page_size,
        "cuda_graph": not args.disable_cuda_graph,
        "enable_mixed_chunk": args.enable_mixed_chunk,
        "enable_piecewise_cuda_graph": args.enable_piecewise_cuda_graph,
        "chunked_prefill_size": args.chunked_prefill_size,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "random_range_ratio": args.random_range_ratio,
        "input_tokens": sum(input_lens),
        "output_tokens": sum(output_lens),
        "max_running_requests": args.max_running_requests,
        "kv_pool_tokens": llm.engine.scheduler.stats().kv_total_tokens,
        "retractions": llm.engine.scheduler.stats().retractions,
        "seconds": elapsed,
        "output_tokens_per_s": sum(output_lens) / elapsed,
        "total_tokens_per_s": (sum(input_lens) + sum(output_lens)) / elapsed,
        "steps": timeline.summary(),
    }
    llm.shutdown()
    report(result, args.out)


if __name__ == "__main__":
    main()
