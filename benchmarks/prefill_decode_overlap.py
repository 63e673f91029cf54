"""Whether a prefill chunk and the running decodes gain from running at the same time, on two
CUDA streams or on two shares of the multiprocessors, against one after the other (as the
engine runs them, mixed or not). The H100's answer, no: benchmarks/README.md, "the
twenty-second session".

A prefill chunk is bound by the GPU's arithmetic and a decode step over long contexts by
reading the KV cache, so on paper the two could share the device: the offline 4096/2048
workload's bound with bf16 KV (benchmarks/README.md, "What bounds the offline figure with
bf16 KV") adds the prompts' time to the decodes' as kernels of one stream must. This measures
what the hardware gives before any engine work is built on it.

With --num-decodes requests decoding at --context-len, a prompt of --prompt-len arrives; for
each step budget in --chunk-sizes, the engine's first mixed step (its chunk and the decodes)
is taken as the scheduler built it and its two parts are timed on the device:

- `extend_ms`, `decode_ms`: the chunk alone (eager), the decodes alone (their CUDA graph);
- `serial_ms`: both, one after the other on one stream;
- `mixed_ms`: both in one forward pass (the engine's `--enable-mixed-chunk` step, eager);
- `concurrent_ms`: the chunk on one stream and the decodes' graph on another, started together;
- with --decode-sms N (a list): the device split into green contexts (FlashInfer's
  `green_ctx`, which needs cuda-python), N multiprocessors for the decodes and the rest for the
  chunk: each part alone on its share (`green_N.extend_ms`, `.decode_ms`, `.decode_eager_ms`),
  and both at once, the decodes by their graph (`.concurrent_ms`) and eagerly
  (`.concurrent_eager_ms`). A part that fails there records its error instead.

The two parts share FlashInfer's scratch buffer, so the concurrent run's outputs are not
right (the timing is what is measured here); an engine that ran them so would need one each.

    python benchmarks/prefill_decode_overlap.py --model benchmarks/models/llama-3.1-8b \\
        --load-format dummy --attention-backend flashinfer \\
        --out benchmarks/results/prefill_decode_overlap_llama8b.json
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable

import torch
from common import engine_facts, engine_parser, make_llm, report
from mixed_step_time import add_scenario_args, decode_tokens, timed_steps

from kubesgl.engine import SamplingParams
from kubesgl.engine.forward_batch import ForwardBatch, ForwardMode
from kubesgl.engine.messages import GenerateRequest


def device_ms(run: Callable[[], object], repeats: int) -> float:
    """Median wall time of `run` with the device drained before and after, in ms."""
    for _ in range(2):  # first use: allocations, autotuning
        run()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def first_mixed_batch(engine, arrival: GenerateRequest) -> ForwardBatch:
    """The first MIXED batch the scheduler builds once `arrival` is queued (that step runs)."""
    runner = engine.executor.runner
    seen: list[ForwardBatch] = []
    launch = runner.run

    def recording_run(batch: ForwardBatch):
        if batch.mode is ForwardMode.MIXED and not seen:
            seen.append(batch)
        return launch(batch)

    runner.run = recording_run
    try:
        engine.add_request(arrival)
        timed_steps(engine, lambda _: bool(seen))
    finally:
        del runner.run  # the class's method again
    return seen[0]


Part = tuple[torch.cuda.Stream, Callable[[], object]]


def concurrently(*parts: Part) -> Callable[[], None]:
    """A run that starts each part on its stream once the work before it is done, and has the
    current stream wait for all of them."""

    def run() -> None:
        main = torch.cuda.current_stream()
        for stream, part in parts:
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                part()
        for stream, _ in parts:
            main.wait_stream(stream)

    return run


def guarded_ms(run: Callable[[], object], repeats: int) -> float | str:
    """`device_ms`, or the error of a run that fails (a green context may refuse a kernel)."""
    try:
        return device_ms(run, repeats)
    except Exception as exc:  # noqa: BLE001 - recorded in the result
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {exc}"


def time_parts(
    engine, batch: ForwardBatch, repeats: int, green: dict[int, tuple[torch.cuda.Stream, ...]]
) -> dict:
    runner = engine.executor.runner
    model, backend, graphs = runner.model, runner.backend, runner.cuda_graphs
    if graphs is None:
        raise SystemExit("this measures the decodes' CUDA graph: run without --disable-cuda-graph")
    batch = batch.to(runner.device)
    input_ids = torch.where(
        batch.input_ids < 0, runner.future_tokens[(-batch.input_ids).clamp(min=0)], batch.input_ids
    )
    runner.mixed_attention.prepare(batch)
    meta = batch.attn
    if meta.decode is None:
        raise SystemExit("the backend attends this mixed step in one pass: use longer contexts")
    extend, decode, n = meta.extend, meta.decode, meta.extend_tokens

    def run_extend() -> None:
        model(input_ids[:n], batch.positions[:n], extend, backend)

    def run_decode() -> None:
        graphs.run(input_ids[n:], decode)

    def run_decode_eager() -> None:
        model(input_ids[n:], batch.positions[n:], decode, backend)

    def run_serial() -> None:
        run_extend()
        run_decode()

    def run_mixed() -> None:
        model(input_ids, batch.positions, batch, runner.mixed_attention)

    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    times: dict = {}
    with torch.inference_mode():
        times["extend_ms"] = device_ms(run_extend, repeats)
        times["decode_ms"] = device_ms(run_decode, repeats)
        times["serial_ms"] = device_ms(run_serial, repeats)
        times["mixed_ms"] = device_ms(run_mixed, repeats)
        times["concurrent_ms"] = device_ms(
            concurrently((side, run_decode), (main, run_extend)), repeats
        )
        for sms, (decode_stream, extend_stream) in green.items():
            cases = {
                "extend_ms": concurrently((extend_stream, run_extend)),
                "decode_ms": concurrently((decode_stream, run_decode)),
                "decode_eager_ms": concurrently((decode_stream, run_decode_eager)),
                "concurrent_ms": concurrently(
                    (decode_stream, run_decode), (extend_stream, run_extend)
                ),
                "concurrent_eager_ms": concurrently(
                    (decode_stream, run_decode_eager), (extend_stream, run_extend)
                ),
            }
            times[f"green_{sms}"] = {name: guarded_ms(run, repeats) for name, run in cases.items()}
    return {
        "chunk_tokens": n,
        "decodes": decode.batch_size,
        **times,
        "concurrent_over_serial": times["concurrent_ms"] / times["serial_ms"],
    }


def green_streams(sms_for_decode: list[int]) -> dict[int, tuple[torch.cuda.Stream, ...]]:
    """For each count N, a stream on N multiprocessors and one on the rest of the device."""
    if not sms_for_decode:
        return {}
    from flashinfer.green_ctx import split_device_green_ctx_by_sm_count

    device = torch.device("cuda", torch.cuda.current_device())
    return {
        sms: tuple(split_device_green_ctx_by_sm_count(device, [sms])[0]) for sms in sms_for_decode
    }


def main() -> None:
    parser = engine_parser(__doc__, dtype="bfloat16", attention_backend="flashinfer")
    add_scenario_args(parser)
    parser.set_defaults(num_decodes=64, prompt_len=8192)
    parser.add_argument("--chunk-sizes", default="2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--decode-sms", default="", help="multiprocessors of the decodes' green context (a list)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this measures CUDA streams: it needs a GPU")
    budgets = [int(size) for size in args.chunk_sizes.split(",")]
    args.decode_tokens = decode_tokens(args, min(budgets)) + len(budgets) * 8
    llm = make_llm(
        args,
        enable_mixed_chunk=True,
        disable_overlap_schedule=True,
        chunked_prefill_size=max(budgets),
        max_running_requests=args.num_decodes + 1,
    )
    engine, scheduler = llm.engine, llm.engine.scheduler
    green = green_streams([int(n) for n in args.decode_sms.split(",") if n])
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompt(length: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(length)]

    decoding = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    for i in range(args.num_decodes):
        engine.add_request(
            GenerateRequest(rid=f"d{i}", input_ids=prompt(args.context_len), params=decoding)
        )
    timed_steps(engine, lambda _: not scheduler.waiting and not scheduler.prefilling)
    runs = []
    for budget in budgets:
        scheduler.limits = dataclasses.replace(scheduler.limits, chunked_prefill_size=budget)
        arrival = GenerateRequest(
            rid=f"p{budget}",
            input_ids=prompt(args.prompt_len),
            params=SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        )
        batch = first_mixed_batch(engine, arrival)
        runs.append({"budget": budget, **time_parts(engine, batch, args.repeats, green)})
        engine.abort_request(arrival.rid)
        timed_steps(engine, lambda _, rid=arrival.rid: rid not in scheduler.requests)
        print(runs[-1], flush=True)
    result = {
        **engine_facts(args, llm),
        "num_decodes": args.num_decodes,
        "context_len": args.context_len,
        "prompt_len": args.prompt_len,
        "runs": runs,
    }
    for i in range(args.num_decodes):
        engine.abort_request(f"d{i}")
    timed_steps(engine, lambda _: not engine.has_work())
    llm.shutdown()
    report(result, args.out)


if __name__ == "__main__":
    main()
