"""How long the host takes to launch each step, and whether the device outran it: the scenario
of mixed_step_time.py (--num-decodes requests decoding at --context-len while a prompt of
--prompt-len tokens arrives, a 256-token budget, mixed chunks on, overlap off) with timers
around the model runner's `run` and its parts (attention's preparation and calls, the
piecewise graphs' replays, the logits). Per step kind, the medians (ms) and how many launches
ended with the device already idle: a step whose launch outlasts the device is bound by its
host, and with overlap the next step's launch cannot hide behind it either. GPU only.

    python benchmarks/step_launch_time.py --model benchmarks/models/llama-3.1-8b \\
        --load-format dummy --enable-piecewise-cuda-graph --out launch.json

The timers wrap the engine's objects from outside (this is a measurement, not an engine
option), so their names follow the engine's code.
"""

from __future__ import annotations

import collections
import functools
import random
import statistics
import time

import torch
from common import engine_facts, engine_parser, make_llm, report
from mixed_step_time import add_scenario_args, decode_tokens, measure

from kubesgl.engine.executor.model_runner import ModelRunner

BUDGET = 256


class Timers:
    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - began

        return timed


def instrument(runner: ModelRunner, timers: Timers, steps: list[dict]) -> None:
    mixed = runner.mixed_attention
    mixed.attend = timers.wrap("attend", mixed.attend)
    mixed.prepare = timers.wrap("prepare_mixed", mixed.prepare)
    runner.backend.prepare = timers.wrap("prepare", runner.backend.prepare)
    pieces = runner.piecewise_graphs
    if pieces is not None:
        for graphs in pieces.pieces.values():
            for graph in graphs:
                graph.replay = timers.wrap("replay", graph.replay)
        pieces.model.logits = timers.wrap("logits", pieces.model.logits)
    launch = runner.run

    def run(batch):
        before = dict(timers.seconds)
        began = time.perf_counter()
        pending = launch(batch)
        host = time.perf_counter() - began
        idle = torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        steps.append(
            {
                "mode": batch.mode.name,
                "tokens": int(batch.num_tokens),
                "host_ms": host * 1e3,
                "total_ms": (time.perf_counter() - began) * 1e3,
                "device_idle_at_launch_end": idle,
                **{k: (v - before.get(k, 0.0)) * 1e3 for k, v in timers.seconds.items()},
            }
        )
        return pending

    runner.run = run


def summarize(steps: list[dict]) -> dict:
    by_mode: dict[str, list[dict]] = collections.defaultdict(list)
    for step in steps:
        by_mode[step["mode"]].append(step)
    summary = {}
    for mode, group in by_mode.items():
        keys = sorted({k for step in group for k in step} - {"mode", "device_idle_at_launch_end"})
        summary[mode] = {
            "steps": len(group),
            "device_idle_at_launch_end": sum(step["device_idle_at_launch_end"] for step in group),
            **{f"{k}_median": statistics.median(s.get(k, 0.0) for s in group) for k in keys},
        }
    return summary


def main() -> None:
    parser = engine_parser(__doc__, dtype="bfloat16", attention_backend="flashinfer")
    add_scenario_args(parser)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark times CUDA launches: it needs a GPU")
    args.profile = False  # what mixed_step_time.measure reads
    args.decode_tokens = decode_tokens(args, BUDGET)
    llm = make_llm(
        args,
        enable_mixed_chunk=True,
        disable_overlap_schedule=True,
        chunked_prefill_size=BUDGET,
        max_running_requests=args.num_decodes + 1,
    )
    steps: list[dict] = []
    instrument(llm.engine.executor.runner, Timers(), steps)
    rng = random.Random(0)
    measure(llm, args, BUDGET, True, rng)  # warm-up
    steps.clear()
    arrival = measure(llm, args, BUDGET, True, rng)
    result = {
        **engine_facts(args, llm),
        "num_decodes": args.num_decodes,
        "context_len": args.context_len,
        "prompt_len": args.prompt_len,
        "budget": BUDGET,
        "by_mode": summarize(steps),
        "arrival": {k: v for k, v in arrival.items() if k != "step_ms"},
    }
    llm.shutdown()
    report(result, args.out)


if __name__ == "__main__":
    main()
