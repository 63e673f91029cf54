"""Requests that set no max_tokens: how many run at once, and the throughput, with admission
on the measured output estimate (optimistic admission with retraction) against reserving
--default-max-tokens for each (the estimate pinned at 1: how admission worked before).

Each request stops on a stop token after a length drawn around --output-median (log-normal,
ShareGPT's spread): a first run with max_tokens set finds the token each request produces at
its length, and the measured runs stop on its first occurrence. So the outputs are known in
advance and checked: none may be cut short or run long. Requests sample (temperature 1, a seed
each), since greedy output of random weights soon repeats itself, which would put most stop
tokens early and leave no long outputs.

    python benchmarks/no_max_tokens.py --model benchmarks/models/llama-3.1-8b --load-format dummy \
        --out benchmarks/results/no_max_tokens_llama8b.json
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
    llm, prompts: list[list[int]], stops: list[int], expected: list[list[int]], mode: str
) -> dict:
    engine = llm.engine
    engine.scheduler.reset()
    engine.scheduler.kv.estimate = MODES[mode]()
    retractions_before = engine.scheduler.stats().retractions
    for i, (prompt, stop) in enumerate(zip(prompts, stops)):
        params = SamplingParams(
            max_tokens=None, temperature=1.0, seed=i, ignore_eos=True, stop_token_ids=[stop]
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
        "outputs_as_expected": sum(g == e for g, e in zip(got, expected)),
        # an output that parted from the reference misses its stop token and runs to the cap
        "outputs_at_cap": sum(len(g) >= engine.scheduler.limits.default_max_tokens for g in got),
        "output_len_mean": tokens / len(got),
    }


def main() -> None:
    parser = engine_parser(__doc__, dtype="bfloat16", attention_backend="triton")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-median", type=int, default=256)
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
    # a stop token may come earlier than the length it was taken at: the output ends there
    expected = [
        out.token_ids[: out.token_ids.index(stop) + 1] for out, stop in zip(reference, stops)
    ]
    results = [run(llm, prompts, stops, expected, mode) for mode in MODES]
    result = {
        **engine_facts(args, llm),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_median": args.output_median,
        "output_len_mean": sum(map(len, expected)) / len(expected),
        "default_max_tokens": cap,
        "max_running_requests": args.max_running_requests,
        "kv_pool_tokens": llm.engine.scheduler.stats().kv_total_tokens,
        "runs": results,
    }
    llm.shutdown()
    report(result, args.out)


if __name__ == "__main__":
    main()
