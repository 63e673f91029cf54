"""Garbage-collection pauses in a busy scheduler loop, with CPython's own pacing and with
kubesgl's (kubesgl/gc_pacing.py): the engine runs in this process under sustained load (new
requests of random prompts as others finish, so the radix cache keeps growing), and every
collection's duration per generation and every step's wall time are recorded.

    kubesgl make-tiny-model /tmp/kubesgl-tiny --arch llama
    python benchmarks/gc_pauses.py --model /tmp/kubesgl-tiny --policy cpython \
        --out benchmarks/results/gc_pauses_cpython.json
    python benchmarks/gc_pauses.py --model /tmp/kubesgl-tiny --policy paced \
        --out benchmarks/results/gc_pauses_paced.json

Defaults: float32, 60 s, 32 requests running of 32 output tokens each.
"""

from __future__ import annotations

import gc
import random
import resource
import statistics
import time

from common import engine_facts, engine_parser, make_llm, report

from kubesgl.bench.serving import percentile
from kubesgl.engine import SamplingParams
from kubesgl.engine.messages import GenerateRequest
from kubesgl.gc_pacing import GcPacer


class PauseLog:
    """Every collection's wall time, by generation (gc.callbacks)."""

    def __init__(self):
        self.ms: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._began = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.ms[info["generation"]].append(1000 * (time.perf_counter() - self._began))

    def summary(self) -> dict:
        return {
            f"gen{generation}": {
                "count": len(times),
                "total_ms": sum(times),
                "max_ms": max(times, default=0.0),
            }
            for generation, times in self.ms.items()
        }


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    parser = engine_parser(__doc__, dtype="float32", attention_backend="auto")
    parser.add_argument("--policy", choices=["cpython", "paced"], required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--running", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = make_llm(args)
    engine = llm.engine
    pacer = GcPacer()
    if args.policy == "paced":
        pacer.start()
    pauses = PauseLog()
    gc.callbacks.append(pauses)
    rng, vocab = random.Random(0), engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    step_ms: list[float] = []  # sorted once the run is over
    submitted, began = 0, time.perf_counter()
    while time.perf_counter() - began < args.seconds:
        while len(engine.scheduler.requests) < args.running:
            prompt = [rng.randrange(10, vocab - 10) for _ in range(rng.randrange(20, 200))]
            engine.add_request(GenerateRequest(f"r{submitted}", prompt, params))
            submitted += 1
        start = time.perf_counter()
        engine.step()
        if args.policy == "paced":
            pacer.tick(busy=True)
        step_ms.append(1000 * (time.perf_counter() - start))
    gc.callbacks.remove(pauses)
    step_ms.sort()
    rss_end_mib = _max_rss_mib()
    collected = gc.collect()  # what a full pass finds now: garbage the paced run left behind
    result = {
        **engine_facts(args, llm),
        "policy": args.policy,
        "seconds": args.seconds,
        "requests": submitted,
        "steps": len(step_ms),
        "step_ms": {
            "p50": statistics.median(step_ms),
            "p99": percentile(step_ms, 0.99),
            "p999": percentile(step_ms, 0.999),
            "max": step_ms[-1],
        },
        "collections": pauses.summary(),
        "tracked_objects_at_end": len(gc.get_objects()),  # frozen ones excluded
        "max_rss_mib": rss_end_mib,
        "unreachable_at_end": collected,
    }
    llm.shutdown()
    report(result, args.out)


if __name__ == "__main__":
    main()
