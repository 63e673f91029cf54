"""Tensor parallelism against one rank, through `kubesgl serve` (the only way to run TP):

- batch-1 decode: one streamed request at a time, `--decode-input` prompt tokens and
  `--decode-output` output tokens; ms per step = the time per output token after the first;
- throughput: `--prompts` requests sent at once, `--input` / `--output` tokens each;
- all-reduces: how many one forward pass makes (counted from the model's layers: every
  attention output and MLP/MoE output, plus the vocab-parallel embedding, and one all-gather
  of the logits) and how long one takes at the decode shape ([batch, hidden] in the model's
  dtype, timed alone over the same backend), so their share of a batch-1 step is estimated.

    python benchmarks/tp_scaling.py --model benchmarks/models/llama-3.1-8b --load-format dummy \\
        --tp-sizes 1 2 --out benchmarks/results/tp_scaling_llama8b.json

On a machine without GPUs the same runs over gloo (`--device cpu`), which is how the script
itself is checked.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import bench_serving, free_port, report

from kubesgl.engine.model_config import load_model_config

# `python -m kubesgl` must not pick up the repository's kubesgl/ folder from the working directory
SUBPROCESS_ENV = {
    **os.environ,
    "PYTHONSAFEPATH": "1",
    "NCCL_NVLS_ENABLE": "0",
}  # NVLink multicast stays off


def allreduces_per_forward(model: str) -> dict:
    config = load_model_config(model)
    return {"all_reduce": 2 * config.num_layers + 1, "all_gather": 1}


def start_server(args, tp: int, port: int, log) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "kubesgl",
        "serve",
        "--model",
        args.model,
        "--load-format",
        args.load_format,
        "--tp-size",
        str(tp),
        "--port",
        str(port),
        "--device",
        args.device,
        "--context-length",
        str(max(args.input + args.output, args.decode_input + args.decode_output) + 16),
        *args.serve_arg,
    ]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=SUBPROCESS_ENV)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(
                f"kubesgl serve --tp-size {tp} exited with {server.returncode}; see {log.name}"
            )
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.terminate()
    raise RuntimeError(f"kubesgl serve --tp-size {tp} was not healthy after {args.start_timeout} s")


def bench(
    port: int, vocab: int, prompts: int, input_len: int, output_len: int, concurrency: int | None
) -> dict:
    options = [
        "--num-prompts",
        str(prompts),
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--vocab-size",
        str(vocab),
    ]
    if concurrency:
        options += ["--max-concurrency", str(concurrency)]
    return bench_serving(f"http://127.0.0.1:{port}", *options, env=SUBPROCESS_ENV)


def _time_allreduce(
    rank: int, size: int, port: int, shape: tuple[int, int], dtype: torch.dtype, device: str, result
) -> None:
    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
    )
    x = torch.ones(shape, dtype=dtype, device=f"cuda:{rank}" if on_gpu else "cpu")
    for _ in range(20):
        dist.all_reduce(x)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    start = time.perf_counter()
    repeats = 200
    for _ in range(repeats):
        dist.all_reduce(x)
    sync()
    if rank == 0:
        result.put((time.perf_counter() - start) / repeats)
    dist.destroy_process_group()


def allreduce_seconds(size: int, shape: tuple[int, int], dtype: torch.dtype, device: str) -> float:
    """One all-reduce of `shape` over `size` ranks, back to back, launch included."""
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = free_port()
    workers = [
        ctx.Process(target=_time_allreduce, args=(r, size, port, shape, dtype, device, result))
        for r in range(size)
    ]
    for w in workers:
        w.start()
    seconds = result.get(timeout=300)
    for w in workers:
        w.join()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--decode-input", type=int, default=128)
    parser.add_argument("--decode-output", type=int, default=512)
    parser.add_argument("--decode-requests", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--input", type=int, default=1024)
    parser.add_argument("--output", type=int, default=512)
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="passed to kubesgl serve (repeatable)"
    )
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = load_model_config(args.model)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    result = {
        "model": args.model,
        "device": args.device,
        "allreduces_per_forward": allreduces_per_forward(args.model),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "runs": {},
    }
    for tp in args.tp_sizes:
        port = free_port()
        with tempfile.NamedTemporaryFile(
            "w", prefix=f"serve-tp{tp}-", suffix=".log", delete=False
        ) as log:
            server = start_server(args, tp, port, log)
            try:
                decode = bench(
                    port,
                    config.vocab_size,
                    args.decode_requests,
                    args.decode_input,
                    args.decode_output,
                    1,
                )
                throughput = bench(
                    port, config.vocab_size, args.prompts, args.input, args.output, None
                )
            finally:
                server.terminate()
                server.wait(timeout=120)
        run = {
            "batch1_ms_per_step": decode["tpot_ms"]["p50"],
            "batch1_itl_p99_ms": decode["itl_ms"]["p99"],
            "throughput_output_tok_s": throughput["output_token_throughput"],
        }
        if tp > 1:
            seconds = allreduce_seconds(tp, (1, config.hidden_size), dtype, args.device)
            count = result["allreduces_per_forward"]["all_reduce"]
            run["allreduce_us_batch1"] = seconds * 1e6
            run["allreduce_share_of_batch1_step"] = (
                count * seconds * 1e3 / run["batch1_ms_per_step"]
            )
        result["runs"][str(tp)] = run
        print(f"tp {tp}: {run}", flush=True)
    report(result, args.out)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
