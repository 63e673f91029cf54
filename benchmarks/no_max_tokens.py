"""Requests that set no max_tokens: how many run at once, and the throughput, with admission
on the measured output estimate (optimistic admission with retraction) against reserving
--default-max-tokens for each (the estimate pinned at 1: how admission worked before).

Each request's length is drawn around --output-median (log-normal, ShareGPT's spread), and
--lengths says how a request comes to stop near it without max_tokens:

- `reference`: a first run with max_tokens set finds the token each request produces at its
  length, and the measured runs stop on its first occurrence. The outputs are known in
  advance and checked (none may be cut short or run long), which needs outputs that do not
  depend on the batch: float32, not bfloat16 (there a sampled output parts from its
  reference as the batch changes, misses its stop token and runs to the cap).
- `stop-set`: each request stops on any of vocab/L random token ids, L its drawn length, so
  with the broad next-token distribution of random weights its output length is geometric
  around L whatever tokens it samples. No reference run and any dtype; the outputs are not
  checked, only counted (their mean length and how many reached the cap are reported).

Requests sample (temperature 1, a seed each), since greedy output of random weights soon
repeats itself.

    python benchmarks/no_max_tokens.py --model benchmarks/models/llama-3.1-8b --load-format dummy \\
        --lengths stop-set --out benchmarks/results/no_max_tokens_llama8b.json
"""

from __future__ import annotations

import math
import random
import sys
import time

import torch
from common import engine_facts, engine_parser, make_llm, report

from kubesgl.engine import SamplingParams
from kubesgl.engine.messages import GenerateRequest
from kubesgl.engine.scheduler.admission import OutputEstimate

MODES = {
    "estimate": OutputEstimate,  # what the engine does
    "full_reservation": lambda: OutputEstimate(ratio=1.0, weight=0.0),  # reserve all of max_tokens
}


def run(
    llm,
    prompts: list[list[int]],
    stops: list[list[int]],
    expected: list[list[int]] | None,
    mode: str,
) -> dict:
    engine = llm.engine
    engine.scheduler.reset()
    engine.scheduler.kv.estimate = MODES[mode]()
    retractions_before = engine.scheduler.stats().retractions
    for i, (prompt, stop) in enumerate(zip(prompts, stops)):
        params = SamplingParams(
            max_tokens=None, temperature=1.0, seed=i, ignore_eos=True, stop_token_ids=stop
        )
        engine.add_request(GenerateRequest(rid=f"{mode}-{i}", input_ids=prompt, params=params))
    outputs: dict[str, list[int]] = {f"{mode}-{i}": [] for i in range(len(prompts))}
    running: list[int] = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = last_report = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            outputs[out.rid] += out.token_ids
        stats = engine.scheduler.stats()
        running.append(stats.num_running)
        if time.perf_counter() - last_report > 10:  # progress, so a slow run shows where it is
            last_report = time.perf_counter()
            print(
                f"{mode}: {len(running)} steps, {stats.num_running} running, "
                f"{stats.num_waiting} waiting, {stats.retractions - retractions_before} retractions",
                file=sys.stderr,
                flush=True,
            )
    elapsed = time.perf_counter() - start
    got = [outputs[f"{mode}-{i}"] for i in range(len(prompts))]
    tokens = sum(len(g) for g in got)
    return {
        "mode": mode,
        "seconds": elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "peak_running": max(running),
        "mean_running": sum(running) / len(running),
        "retractions": engine.scheduler.stats().retractions - retractions_before,
        "final_ratio": engine.scheduler.kv.estimate.ratio,
        "outputs_as_expected": (
            None if expected is None else sum(g == e for g, e in zip(got, expected))
        ),
        # an output that parted from the reference misses its stop token and runs to the cap
        "outputs_at_cap": sum(len(g) >= engine.scheduler.limits.default_max_tokens for g in got),
        "output_len_mean": tokens / len(got),
    }


def reference_stops(
    llm, prompts: list[list[int]], lengths: list[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """Per request, the token its reference output ends with, and the output expected when
    that token stops it (at its first occurrence, which may come before its drawn length)."""
    began = time.perf_counter()
    reference = llm.generate(
        prompts,
        [
            SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
            for i, n in enumerate(lengths)
        ],
    )
    print(f"reference run: {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    stops = [out.token_ids[-1] for out in reference]
    expected = [
        out.token_ids[: out.token_ids.index(stop) + 1] for out, stop in zip(reference, stops)
    ]
    return [[stop] for stop in stops], expected


def main() -> None:
    parser = engine_parser(__doc__, dtype="bfloat16", attention_backend="triton")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-median", type=int, default=256)
    parser.add_argument("--lengths", choices=("reference", "stop-set"), default="reference")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = make_llm(args)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, vocab - 10) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]
    cap = llm.engine.scheduler.limits.default_max_tokens
    lengths = [
        min(cap, max(1, int(math.exp(rng.gauss(math.log(args.output_median), 0.9)))))
        for _ in range(args.num_prompts)
    ]
    if args.lengths == "reference":
        stops, expected = reference_stops(llm, prompts, lengths)
    else:
        stops = [rng.sample(range(vocab), max(1, round(vocab / n))) for n in lengths]
        expected = None
    results = [run(llm, prompts, stops, expected, mode) for mode in MODES]
    result = {
        **engine_facts(args, llm),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_median": args.output_median,
        "lengths": args.lengths,
        "drawn_len_mean": sum(lengths) / len(lengths),
        "default_max_tokens": cap,
        "max_running_requests": args.max_running_requests,
        "kv_pool_tokens": llm.engine.scheduler.stats().kv_total_tokens,
        "runs": results,
    }
    llm.shutdown()
    report(result, args.out)


if __name__ == "__main__":
    main()
