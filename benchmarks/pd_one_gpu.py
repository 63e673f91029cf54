"""Prefill/decode disaggregation against a mixed engine on the same device, one after the other:
a prefill and a decode engine (`kubesgl serve --role ...`) behind `kubesgl router`, KV moved
by NIXL (VRAM to VRAM on a GPU), against one mixed engine behind the same router.

For each setup: TTFT and ITL of `kubesgl bench serving` at a request rate; TTFT of single
long prompts one at a time (and, for P/D, the KV write's time, size and bandwidth from the
prefill engine's metrics: the handoff's share of TTFT); greedy tokens of a few prompts,
compared between the setups. Both roles share one GPU here, so this measures the cost of
the handoff, not what disaggregation gains (that needs a GPU per role).

    python benchmarks/pd_one_gpu.py --model benchmarks/models/llama-3.1-8b --load-format dummy \\
        --attention-backend triton --out benchmarks/results/pd_one_gpu_llama8b.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import httpx
from common import bench_serving, free_port, report


def start(
    args: list[str], log_dir: str, name: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    log = open(os.path.join(log_dir, f"{name}.log"), "w")
    return subprocess.Popen(
        [sys.executable, "-m", "kubesgl", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def wait_healthy(
    url: str, process: subprocess.Popen, log_dir: str, name: str, timeout: float = 900
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(
                f"{name} exited:\n" + open(os.path.join(log_dir, f"{name}.log")).read()[-3000:]
            )
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} not healthy after {timeout} s")


@dataclass(frozen=True)
class EngineProcess:
    name: str  # also the key of its URL
    args: tuple[str, ...] = ()  # beyond the common engine options
    gpu: str | None = None  # CUDA_VISIBLE_DEVICES for it; None: all devices


def add_engine_options(parser: argparse.ArgumentParser, max_total_tokens: int) -> None:
    """The engines' options, which engine_command passes on, and the prompts' vocabulary."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=max_total_tokens,
        help="KV pool of each engine, in tokens",
    )
    parser.add_argument("--context-length", type=int, default=8192)
    parser.add_argument(
        "--vocab-size", type=int, default=128_000, help="prompt token ids are drawn below this"
    )


def engine_command(opts: argparse.Namespace) -> list[str]:
    command = [
        "serve",
        "--model",
        opts.model,
        "--load-format",
        opts.load_format,
        "--dtype",
        opts.dtype,
        "--device",
        opts.device,
        "--max-total-tokens",
        str(opts.max_total_tokens),
        "--context-length",
        str(opts.context_length),
        "--served-model-name",
        "bench",
        "--host",
        "127.0.0.1",
        "--log-level",
        "warning",
    ]
    return command + (
        ["--attention-backend", opts.attention_backend] if opts.attention_backend else []
    )


@contextlib.contextmanager
def serving_stack(
    engines: list[EngineProcess], router_workers, opts: argparse.Namespace, log_dir: str
):
    """`engines` started one at a time (each sizes itself after the ones before), then a router
    given `router_workers(urls)`; yields the router's URL and the engines' URLs by name."""
    processes, urls = {}, {}
    try:
        for engine in engines:
            port = free_port()
            urls[engine.name] = f"http://127.0.0.1:{port}"
            env = {"CUDA_VISIBLE_DEVICES": engine.gpu} if engine.gpu is not None else {}
            processes[engine.name] = start(
                engine_command(opts) + ["--port", str(port), *engine.args],
                log_dir,
                engine.name,
                env,
            )
            wait_healthy(urls[engine.name], processes[engine.name], log_dir, engine.name)
        port = free_port()
        processes["router"] = start(
            [
                "router",
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--log-level",
                "warning",
                *router_workers(urls),
            ],
            log_dir,
            "router",
        )
        router = f"http://127.0.0.1:{port}"
        wait_healthy(router, processes["router"], log_dir, "router")
        yield router, urls
    finally:
        for process in processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def stack(mode: str, opts: argparse.Namespace, log_dir: str):
    """One mixed engine, or a prefill and a decode engine, on the same device behind the router."""
    if mode == "mixed":
        return serving_stack(
            [EngineProcess("mixed")], lambda urls: ["--worker", urls["mixed"]], opts, log_dir
        )
    bootstrap = free_port()
    engines = [
        EngineProcess(
            "prefill", ("--role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap))
        ),
        EngineProcess(
            "decode",
            (
                "--role",
                "decode",
            ),
        ),
    ]
    return serving_stack(
        engines,
        lambda urls: [
            "--prefill",
            f"{urls['prefill']}@{bootstrap}",
            "--decode",
            urls["decode"],
            "--pd-min-prefill-tokens",
            "0",
        ],
        opts,
        log_dir,
    )


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def first_token_time(router: str, prompt: list[int]) -> float:
    """Seconds to the first streamed token of one request."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("no token came")


def greedy(router: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [
        httpx.post(
            router + "/generate",
            json={
                "input_ids": p,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            },
            timeout=300,
        ).json()["output_ids"]
        for p in prompts
    ]


def kv_write_under_load(
    router: str, urls: dict, rng: random.Random, opts: argparse.Namespace
) -> dict:
    """Mean KV write time of prompts of two lengths, with the decode engine idle and with it
    decoding a batch of its own requests (on one GPU both engines' work shares the device)."""

    def writes(length: int) -> float:
        before = (
            metric(urls["prefill"], "kubesgl_kv_transfer_seconds_sum"),
            metric(urls["prefill"], "kubesgl_kv_transfer_seconds_count"),
        )
        for _ in range(3):
            first_token_time(router, [rng.randrange(10, opts.vocab_size) for _ in range(length)])
        return (
            (metric(urls["prefill"], "kubesgl_kv_transfer_seconds_sum") - before[0])
            / (metric(urls["prefill"], "kubesgl_kv_transfer_seconds_count") - before[1])
            * 1e3
        )

    result = {f"idle_{n}": writes(n) for n in (opts.input_len, opts.long_input_len)}
    stop = threading.Event()

    def decode_load() -> (
        None
    ):  # requests of the decode engine's own (no room): it decodes them itself
        while not stop.is_set():
            httpx.post(
                urls["decode"] + "/generate",
                timeout=300,
                json={
                    "input_ids": [rng.randrange(10, opts.vocab_size) for _ in range(64)],
                    "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
                },
            )

    load = [threading.Thread(target=decode_load) for _ in range(16)]
    for thread in load:
        thread.start()
    time.sleep(2)
    result.update({f"decoding_{n}": writes(n) for n in (opts.input_len, opts.long_input_len)})
    stop.set()
    for thread in load:
        thread.join()
    return result


def run(mode: str, opts: argparse.Namespace) -> dict:
    rng = random.Random(0)
    longs = [
        [rng.randrange(10, opts.vocab_size) for _ in range(opts.long_input_len)]
        for _ in range(opts.long_prompts)
    ]
    shorts = [[rng.randrange(10, opts.vocab_size) for _ in range(64)] for _ in range(4)]
    with tempfile.TemporaryDirectory() as log_dir, stack(mode, opts, log_dir) as (router, urls):
        first_token_time(router, longs[0])  # warm up the path (and JIT) once
        prefill = urls.get("prefill")
        before = (
            (
                metric(prefill, "kubesgl_kv_transfer_seconds_sum"),
                metric(prefill, "kubesgl_kv_transfer_seconds_count"),
                metric(prefill, "kubesgl_kv_transfer_bytes_total"),
            )
            if prefill
            else None
        )
        long_ttfts = [first_token_time(router, prompt) for prompt in longs[1:]]
        result = {
            "long_prompt_ttft_ms": [t * 1e3 for t in long_ttfts],
            "long_prompt_ttft_ms_median": statistics.median(long_ttfts) * 1e3,
        }
        if prefill:
            after = (
                metric(prefill, "kubesgl_kv_transfer_seconds_sum"),
                metric(prefill, "kubesgl_kv_transfer_seconds_count"),
                metric(prefill, "kubesgl_kv_transfer_bytes_total"),
            )
            writes = after[1] - before[1]
            write_s = (after[0] - before[0]) / writes
            nbytes = (after[2] - before[2]) / writes
            result["kv_write"] = {
                "writes": writes,
                "seconds_mean": write_s,
                "bytes_per_request": nbytes,
                "gbytes_per_s": nbytes / write_s / 1e9,
                "share_of_long_prompt_ttft": write_s / statistics.median(long_ttfts),
            }
        if prefill:
            result["kv_write_ms_by_decode_load"] = kv_write_under_load(router, urls, rng, opts)
        result["greedy"] = greedy(router, shorts, opts.greedy_tokens)
        watched = {
            "decode_kv_wait": ("decode", "kubesgl_kv_transfer_wait_seconds"),
            "prefill_slots_wait": ("prefill", "kubesgl_kv_transfer_wait_seconds"),
            "prefill_kv_write": ("prefill", "kubesgl_kv_transfer_seconds"),
            "prefill_ttft": ("prefill", "kubesgl_time_to_first_token_seconds"),
            "engine_ttft": (
                "decode" if prefill else "mixed",
                "kubesgl_time_to_first_token_seconds",
            ),
        }

        def sums():
            return {
                key: (metric(urls[role], name + "_sum"), metric(urls[role], name + "_count"))
                for key, (role, name) in watched.items()
                if role in urls
            }

        before = sums()
        result["serving"] = bench_serving(
            router,
            "--model",
            "bench",
            "--random-input-len",
            str(opts.input_len),
            "--random-output-len",
            str(opts.output_len),
            "--vocab-size",
            str(opts.vocab_size),
            "--request-rate",
            str(opts.rate),
            "--num-prompts",
            str(opts.num_prompts),
        )
        # where the time went, from the engines' own histograms: the mean of each over the run
        result["serving"]["stages_ms_mean"] = {
            key: (total - before[key][0]) / max(count - before[key][1], 1) * 1e3
            for key, (total, count) in sums().items()
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_options(parser, max_total_tokens=200_000)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--long-input-len", type=int, default=4096)
    parser.add_argument("--long-prompts", type=int, default=6, help="the first warms up")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    mixed, pd = run("mixed", opts), run("pd", opts)
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
        for x, y in zip(mixed["greedy"], pd["greedy"])
    ]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "model": opts.model,
        "load_format": opts.load_format,
        "attention_backend": opts.attention_backend,
        "mixed": mixed,
        "pd": pd,
        "greedy_tokens_equal_before_first_difference": agree,
        "ttft_p50_ratio_pd_over_mixed": pd["serving"]["ttft_ms"]["p50"]
        / mixed["serving"]["ttft_ms"]["p50"],
        "long_prompt_ttft_ratio_pd_over_mixed": pd["long_prompt_ttft_ms_median"]
        / mixed["long_prompt_ttft_ms_median"],
    }
    report(result, opts.out)


if __name__ == "__main__":
    main()
