"""What one step costs while a long prompt arrives: with --num-decodes requests decoding at
--context-len, a request of --prompt-len tokens comes in, and each step until its first token
is timed. For each step budget (--chunk-sizes, --chunked-prefill-size), with mixed chunks
(its chunk rides with the decodes) and without (its chunks run alone, the decodes wait), the
median and longest step, and the decode step alone for scale.

A running request's gap between two tokens (ITL) is one such step, so this is what an engine's
ITL p99 rests on when long prompts arrive, and which budget keeps it within 2x a decode step.

    python benchmarks/mixed_step_time.py --model benchmarks/models/llama-3.1-8b \\
        --load-format dummy --attention-backend flashinfer \\
        --out benchmarks/results/mixed_step_time_llama8b.json

One engine serves every setting (its budget and mixing are set between measurements), with
overlap off so that each step's wall time is that step's alone. With --overlap the engine
runs as it serves (the host prepares each step while the one before runs on the device), and
a step's time is the interval between two calls of the engine's `step` returning, each with
the outputs of the step before it: whether the host's part of a mixed step hides behind the
device or adds to what the running requests wait.

With --profile (a GPU only) the arrival's steps run under torch.profiler, and each setting
also records the device kernels of its average step (`kernels_per_step`, the 15 longest) and
how long per step the device was busy and idle (`device_busy_ms`, `device_idle_ms`): a step
whose wall time is well above its busy time is bound by its host. The profiler slows the
host, so the step times of a profiled run are not the ones to quote.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch
from common import engine_facts, engine_parser, make_llm, report
from kernel_profile import kernel_profile

from kubesgl.engine import SamplingParams
from kubesgl.engine.messages import GenerateRequest


@dataclasses.dataclass(frozen=True)
class Step:
    seconds: float  # the step's wall time
    ended_at: float  # since the first of its series began
    watched_token: bool  # whether it gave the watched request a token


def timed_steps(engine, until, watched: str | None = None) -> list[Step]:
    """Step the engine until `until(steps taken)` holds, timing each step (with overlap off,
    each step waits for the device; with it on, each returns the step before's outputs)."""
    steps: list[Step] = []
    start = time.perf_counter()
    while not until(len(steps)):
        begin = time.perf_counter()
        outputs = engine.step()
        if torch.cuda.is_available() and not engine.scheduler.overlap:
            torch.cuda.synchronize()
        end = time.perf_counter()
        got = any(out.rid == watched and out.token_ids for out in outputs)
        steps.append(Step(end - begin, end - start, got))
    return steps


def measure(llm, args, budget: int, mixed: bool, rng: random.Random) -> dict:
    engine = llm.engine
    scheduler = engine.scheduler
    scheduler.limits = dataclasses.replace(
        scheduler.limits, chunked_prefill_size=budget, mixed_chunk=mixed
    )
    vocab = engine.model_config.vocab_size

    def prompt(length: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(length)]

    decodes = [f"d{budget}-{mixed}-{i}" for i in range(args.num_decodes)]
    for rid in decodes:
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
        engine.add_request(
            GenerateRequest(rid=rid, input_ids=prompt(args.context_len), params=params)
        )
    timed_steps(engine, lambda _: not scheduler.waiting and not scheduler.prefilling)
    decode_ms = [1000 * step.seconds for step in timed_steps(engine, lambda n: n == args.steps)]

    arrival = f"p{budget}-{mixed}"
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request(
        GenerateRequest(rid=arrival, input_ids=prompt(args.prompt_len), params=params)
    )
    steps: list[Step] = []

    def arrival_steps() -> None:
        steps.extend(timed_steps(engine, lambda _: arrival not in scheduler.requests, decodes[0]))

    profiled = None
    if args.profile:
        whole = kernel_profile(arrival_steps)
        profiled = whole.per(len(steps))
    else:
        arrival_steps()
    for rid in decodes:
        engine.abort_request(rid)
    timed_steps(engine, lambda _: not engine.has_work())
    scheduler.reset()
    ms = [1000 * step.seconds for step in steps]
    # a decode's longest wait for its next token: from the last token before the prompt came
    # (time 0) to the first after, between two tokens while the prompt was prefilled, and from
    # the last one to the end of the prompt's steps
    marks = [0.0] + [1000 * step.ended_at for step in steps if step.watched_token]
    marks.append(1000 * steps[-1].ended_at)
    result = {
        "budget": budget,
        "mixed": mixed,
        "decode_step_ms": statistics.median(decode_ms),
        "steps_until_first_token": len(steps),
        "time_to_first_token_ms": sum(ms),
        "step_ms_median": statistics.median(ms),
        "step_ms_max": max(ms),
        "longest_decode_gap_ms": max(b - a for a, b in zip(marks, marks[1:])),
        "step_ms": [round(t, 2) for t in ms],  # which step is the slow one
    }
    if profiled is not None:
        result["device_busy_ms"] = profiled.busy_us / 1000
        result["device_idle_ms"] = profiled.idle_us / 1000
        result["kernels_per_step"] = profiled.kernels[:15]
    return result


def add_scenario_args(parser: argparse.ArgumentParser) -> None:
    """The decodes running and the prompt arriving (also step_launch_time.py's)."""
    parser.add_argument("--num-decodes", type=int, default=16)
    parser.add_argument("--context-len", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed alone")


def decode_tokens(args: argparse.Namespace, smallest_budget: int) -> int:
    """Enough outputs that the decodes outlast every phase of one setting: their own prompts
    (mixed, they decode meanwhile), the steps timed alone, and the arrival's prompt."""
    chunk = max(1, smallest_budget - args.num_decodes)
    return (args.num_decodes * args.context_len + args.prompt_len) // chunk + args.steps + 64


def main() -> None:
    parser = engine_parser(__doc__, dtype="bfloat16", attention_backend="triton")
    add_scenario_args(parser)
    parser.add_argument("--chunk-sizes", default="256,512,1024,2048,4096")
    parser.add_argument("--profile", action="store_true", help="record the kernels (GPU)")
    parser.add_argument(
        "--overlap", action="store_true", help="overlap scheduling on, as the engine serves"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.profile and not torch.cuda.is_available():
        parser.error("--profile records CUDA kernels: it needs a GPU")
    budgets = [int(size) for size in args.chunk_sizes.split(",")]
    args.decode_tokens = decode_tokens(args, min(budgets))
    llm = make_llm(
        args,
        enable_mixed_chunk=True,
        disable_overlap_schedule=not args.overlap,
        chunked_prefill_size=max(budgets),
        max_running_requests=args.num_decodes + 1,  # the decodes and the arrival
    )
    rng = random.Random(0)
    measure(llm, args, budgets[0], True, rng)  # warm-up: first-use compilation and allocation
    runs = [measure(llm, args, budget, mixed, rng) for budget in budgets for mixed in (True, False)]
    result = {
        **engine_facts(args, llm),
        "num_decodes": args.num_decodes,
        "context_len": args.context_len,
        "prompt_len": args.prompt_len,
        "overlap": args.overlap,
        "runs": runs,
    }
    llm.shutdown()
    report(result, args.out)


if __name__ == "__main__":
    main()
