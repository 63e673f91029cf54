"""Where a decode step's time goes: the CUDA-graph replay alone (device time, CUDA events)
against the whole step as the engine runs it (host time), and the replay's kernels one by one
(torch.profiler records each kernel node of a replayed graph), for one batch size.

    python benchmarks/profile_decode_step.py --model benchmarks/models/llama-3.1-8b --load-format dummy \
        --attention-backend flashinfer --batch 1 --out benchmarks/results/profile_decode.json

`kernels` lists each kernel name with its launches and device microseconds (`us`) per replay,
longest first; `idle_us_per_replay` is the time no kernel covers from the first kernel's start to the
last one's end, per replay (the gaps between graph nodes, and between the back-to-back replays).
"""

from __future__ import annotations

import time

import torch
from common import engine_facts, engine_parser, make_llm, report
from kernel_profile import kernel_profile

from kubesgl.engine.messages import GenerateRequest
from kubesgl.engine.sampling_params import SamplingParams


def main() -> None:
    parser = engine_parser(__doc__, dtype="bfloat16", attention_backend="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--replays", type=int, default=20, help="replays profiled")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = make_llm(
        args,
        max_running_requests=args.batch,
        context_length=4096,
        max_total_tokens=args.batch * 4096,
    )
    engine = llm.engine
    graphs = engine.executor.runner.cuda_graphs
    if graphs is None:
        llm.shutdown()
        parser.error("no decode CUDA graphs: this needs a GPU and CUDA graphs on")
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
    graph = graphs.graphs[args.batch]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    end.synchronize()
    replay_ms = start.elapsed_time(end) / 100
    profiled = kernel_profile(lambda: [graph.replay() for _ in range(args.replays)])
    replays = profiled.per(args.replays)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        engine.step()
    step_ms = (time.perf_counter() - t0) * 1e3 / 100
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    result = {
        **engine_facts(args, llm),
        "batch": args.batch,
        "context": args.context,
        "graph_replay_ms": replay_ms,
        "engine_step_ms": step_ms,
        "weight_gb": weight_bytes / 1e9,
        "replay_bandwidth_tb_s": weight_bytes / replay_ms / 1e9,
        "kernel_us_per_replay": sum(k["us"] for k in replays.kernels),
        "idle_us_per_replay": replays.idle_us,
        "kernels": replays.kernels,
    }
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    llm.shutdown()
    report(result, args.out)


if __name__ == "__main__":
    main()
