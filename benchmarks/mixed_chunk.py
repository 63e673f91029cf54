"""Online serving with and without mixed chunks (--enable-mixed-chunk): for each engine setting,
one `kubesgl serve` is started and `kubesgl bench serving`'s load (random prompts, Poisson
arrivals, streamed answers) runs each workload against it; TTFT, ITL (p50, p99 and their
ratio), TPOT and throughput per setting and workload go to one JSON.

The question it answers: does a decode step still wait behind a whole prefill (ITL p99 far
above p50) when long prompts arrive, and what does mixing cost in TTFT and throughput?

    python benchmarks/mixed_chunk.py --model benchmarks/models/llama-3.1-8b --load-format dummy \\
        --out benchmarks/results/mixed_chunk_llama8b.json

A workload is IN/OUT@RATE:N (prompt and output tokens, requests per second, requests); a
setting is NAME=FLAGS (kubesgl serve flags added to --engine-args). Without --model the tiny
llama runs on the CPU (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import httpx
from common import free_port, report
from pd_one_gpu import start, wait_healthy

from kubesgl.bench.datasets import random_requests
from kubesgl.bench.serving import run, summarize

SETTINGS = [
    "off=",
    "mixed=--enable-mixed-chunk",
    "mixed-512=--enable-mixed-chunk --chunked-prefill-size 512",
]
WORKLOADS = ["4096/256@4:24", "512/256@16:96"]
_WORKLOAD = re.compile(r"(\d+)/(\d+)@([\d.]+):(\d+)$")


def parse_workload(text: str) -> tuple[int, int, float, int]:
    match = _WORKLOAD.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not IN/OUT@RATE:N, e.g. 4096/256@4:24")
    return int(match[1]), int(match[2]), float(match[3]), int(match[4])


def parse_setting(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=FLAGS, e.g. mixed=--enable-mixed-chunk"
        )
    return name, shlex.split(flags)


def serve(command: list[str], log_dir: str, name: str) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    began = time.perf_counter()
    process = start([*command, "--port", str(port)], log_dir, name)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, log_dir, name)
    return process, url, time.perf_counter() - began


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def measure(url: str, workload: tuple[int, int, float, int], vocab: int, seed: int) -> dict:
    input_len, output_len, rate, count = workload
    requests = random_requests(count, input_len, output_len, 1.0, vocab, random.Random(seed))
    results, duration = asyncio.run(run(url, "bench", requests, rate, None, seed))
    summary = summarize(results, duration)
    itl = summary["itl_ms"]
    return {
        "completed": summary["completed"],
        "failed": summary["failed"],
        "errors": summary["errors"],
        "duration_s": duration,
        "output_token_throughput": summary["output_token_throughput"],
        "ttft_ms": summary["ttft_ms"],
        "itl_ms": itl,
        "tpot_ms": summary["tpot_ms"],
        "itl_p99_over_p50": itl["p99"] / itl["p50"] if itl else None,
    }


def _line(run: dict) -> str:
    if not run["itl_ms"]:  # every request failed, or none streamed a second token
        return f"{run['completed']} completed, {run['failed']} failed: {run['errors'][:3]}"
    return (
        f"ITL p50 {run['itl_ms']['p50']:7.2f} p99 {run['itl_ms']['p99']:7.2f} ms, "
        f"TTFT p50 {run['ttft_ms']['p50']:8.1f} p99 {run['ttft_ms']['p99']:8.1f} ms, "
        f"{run['output_token_throughput']:8.1f} out tok/s, {run['failed']} failed"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help="a model directory (default: the tiny llama on the CPU, made here)"
    )
    parser.add_argument("--load-format", default="auto")
    parser.add_argument(
        "--engine-args",
        default="--context-length 8192",
        help="kubesgl serve flags of every setting, one string",
    )
    parser.add_argument(
        "--setting",
        dest="settings",
        action="append",
        type=parse_setting,
        help=f"NAME=FLAGS, repeatable (default: {' '.join(SETTINGS)})",
    )
    parser.add_argument(
        "--workload",
        dest="workloads",
        action="append",
        type=parse_workload,
        help=f"IN/OUT@RATE:N, repeatable (default: {' '.join(WORKLOADS)})",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="prompt token ids are drawn below this (default: the model's vocabulary)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    settings = opts.settings or [parse_setting(s) for s in SETTINGS]
    workloads = opts.workloads or [parse_workload(w) for w in WORKLOADS]
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        model, engine_args = opts.model, shlex.split(opts.engine_args)
        if model is None:
            from kubesgl.engine.models.tiny import make_tiny_model

            model = str(make_tiny_model(os.path.join(scratch, "tiny"), "llama", 0, 16))
            engine_args += ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "32768"]
        base = [
            "serve",
            "--model",
            model,
            "--load-format",
            opts.load_format,
            "--served-model-name",
            "bench",
            "--host",
            "127.0.0.1",
            "--log-level",
            "warning",
            *engine_args,
        ]
        results = {}
        for name, flags in settings:
            try:
                process, url, startup = serve(base + flags, scratch, name)
            except SystemExit as refused:  # an engine that refused its flags: the others still run
                results[name] = {"flags": flags, "error": str(refused)}
                print(f"{name}: did not start: {refused}", file=sys.stderr, flush=True)
                continue
            try:
                vocab = (
                    opts.vocab_size
                    or httpx.get(url + "/model_info", timeout=30).json()["vocab_size"]
                )
                for input_len, *_ in workloads:  # warm-up: compile and plan each prompt length once
                    measure(url, (input_len, 4, float("inf"), 2), vocab, opts.seed + 1)
                runs = {
                    f"{w[0]}/{w[1]}@{w[2]:g}": measure(url, w, vocab, opts.seed) for w in workloads
                }
            finally:
                stop(process)
            results[name] = {"flags": flags, "startup_s": startup, "workloads": runs}
            for workload, r in runs.items():
                print(f"{name:>12} {workload:>14}: {_line(r)}", flush=True)
    report(
        {
            "date": time.strftime("%Y-%m-%d"),
            "model": opts.model or "tiny llama (make-tiny-model), float32, CPU",
            "load_format": opts.load_format,
            "engine_args": engine_args,
            "settings": results,
            "wall_s": time.perf_counter() - began,
        },
        opts.out,
    )


if __name__ == "__main__":
    main()
