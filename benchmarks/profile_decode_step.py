"""Where a decode step's time goes: the CUDA-graph replay alone (device time, CUDA events)
against the whole step as the engine runs it (host time), for one batch size.

    python benchmarks/profile_decode_step.py --model benchmarks/models/llama-3.1-8b --load-format dummy --batch 1
"""

from __future__ import annotations

import argparse
import time

import torch
from common import report

from kubesgl.engine import LLM, SamplingParams
from kubesgl.engine.messages import GenerateRequest


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype="bfloat16",
        attention_backend="triton",
        max_running_requests=args.batch,
        context_length=4096,
        max_total_tokens=args.batch * 4096,
    )
    engine = llm.engine
    runner = engine.executor.runner
    for i in range(args.batch):
        engine.add_request(
            GenerateRequest(
                f"r{i}",
                list(range(10, 10 + args.context)),
                SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True),
            )
        )
    for _ in range(20):
        engine.step()
    graph = runner.cuda_graphs.graphs[
        runner.cuda_graphs.batch_sizes[0] if args.batch == 1 else args.batch
    ]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    end.synchronize()
    replay_ms = start.elapsed_time(end) / 100
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        engine.step()
    step_ms = (time.perf_counter() - t0) * 1e3 / 100
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    result = {
        "batch": args.batch,
        "context": args.context,
        "graph_replay_ms": replay_ms,
        "engine_step_ms": step_ms,
        "weight_gb": weight_bytes / 1e9,
        "replay_bandwidth_tb_s": weight_bytes / replay_ms / 1e9,
    }
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    llm.shutdown()
    report(result, args.out)


if __name__ == "__main__":
    main()
