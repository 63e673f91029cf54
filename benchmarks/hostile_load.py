"""One hostile request beside a steady stream of normal ones (robustness issue): how much does
it hold the others up?

An engine is started (the tiny model on the CPU unless --model is given), a steady stream of
normal completions runs for a window, and one hostile request of a kind is sent a second into
it. For each kind: the hostile request's status and time, and the normal requests' worst and
median latency, against the same window with no hostile request (the idle figure). An engine
that dies is recorded as such and started anew for the next kind. The engine is started with
the interpreter that runs this script, so the same command run from two checkouts compares them.

    python benchmarks/hostile_load.py --out benchmarks/results/hostile_load_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time

import httpx
from common import free_port, report
from pd_one_gpu import start, wait_healthy

API_KEY = "sk-bench"


def hostile_requests() -> dict[str, dict]:
    """Kind -> body for /v1/completions; each is one request that used to stall or kill an engine."""
    return {
        "fan_out_500_prompts_n_64": {"prompt": ["a"] * 500, "n": 64, "max_tokens": 16},
        "16_stop_strings_of_100_kb": {
            "prompt": "once upon a time",
            "max_tokens": 200,
            "ignore_eos": True,
            "stop": [f"{i}" + "x" * 100_000 for i in range(16)],
        },
        "5_mb_prompt": {"prompt": "a " * 2_500_000, "max_tokens": 4},
        "1m_token_ids": {"prompt": [1] * 1_000_000, "max_tokens": 4},
        "lone_surrogate": {"prompt": "cut emoji \ud83d", "max_tokens": 4},
    }


class Engine:
    """A `kubesgl serve` process run by this interpreter."""

    def __init__(self, model: str, extra: list[str], log_dir: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        name = f"engine-{self.port}"
        self.process = start(
            [
                "serve",
                "--model",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--api-key",
                API_KEY,
                "--served-model-name",
                "m",
                *extra,
            ],
            log_dir,
            name,
        )
        wait_healthy(self.url, self.process, log_dir, name, timeout=300)

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def window(url: str, rate: float, seconds: float, hostile: dict | None) -> dict:
    """Normal requests at `rate` per second for `seconds`; `hostile` sent after one second."""
    headers = {"authorization": f"Bearer {API_KEY}"}
    normal = {
        "model": "m",
        "prompt": "The quick brown fox jumps over the lazy dog",
        "max_tokens": 16,
        "temperature": 0,
    }
    latencies: list[float] = []
    failures: list[int] = []
    outcome: dict = {}
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=300, limits=httpx.Limits(max_connections=None)
    ) as client:

        async def one_normal() -> None:
            started = time.perf_counter()
            try:
                response = await client.post("/v1/completions", json=normal)
                status = response.status_code
            except httpx.HTTPError:
                status = 0
            (
                latencies.append(time.perf_counter() - started)
                if status == 200
                else failures.append(status)
            )

        async def one_hostile() -> None:
            await asyncio.sleep(1.0)
            started = time.perf_counter()
            try:
                # json.dumps escapes a lone surrogate as \ud83d, as a JavaScript client sends it
                response = await client.post(
                    "/v1/completions",
                    content=json.dumps({"model": "m", **hostile}),
                    headers={"content-type": "application/json"},
                )
                outcome.update(
                    status=response.status_code,
                    error=response.json().get("error", {}).get("type")
                    if response.status_code != 200
                    else None,
                )
            except (httpx.HTTPError, ValueError) as error:
                outcome.update(status=None, error=type(error).__name__)
            outcome["seconds"] = round(time.perf_counter() - started, 3)

        tasks = [asyncio.create_task(one_hostile())] if hostile else []
        begin = time.perf_counter()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, begin + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one_normal()))
        await asyncio.gather(*tasks)
    return {
        "normal_completed": len(latencies),
        "normal_failed": failures,
        "normal_worst_s": round(max(latencies), 3) if latencies else None,
        "normal_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        **({"hostile": outcome} if hostile else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a model directory (default: the tiny llama, made here)")
    parser.add_argument(
        "--engine-args",
        default="--device cpu --dtype float32",
        help="more `kubesgl serve` options, one string",
    )
    parser.add_argument("--rate", type=float, default=4.0, help="normal requests per second")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each window")
    parser.add_argument("--kinds", nargs="*", help="hostile kinds to send (default: all)")
    parser.add_argument("--out", help="write the JSON result here too")
    opts = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        model = opts.model
        if model is None:
            from kubesgl.engine.models.tiny import make_tiny_model

            model = str(make_tiny_model(os.path.join(scratch, "tiny"), "llama", 0, 16))
        extra = opts.engine_args.split()
        engine = Engine(model, extra, scratch)
        asyncio.run(window(engine.url, opts.rate, 2.0, None))  # warm-up
        idle = asyncio.run(window(engine.url, opts.rate, opts.seconds, None))
        kinds = {}
        for kind, body in hostile_requests().items():
            if opts.kinds and kind not in opts.kinds:
                continue
            result = asyncio.run(window(engine.url, opts.rate, opts.seconds, body))
            result["engine_survived"] = engine.healthy() and engine.process.poll() is None
            if result["normal_worst_s"] and idle["normal_worst_s"]:
                result["worst_vs_idle"] = round(
                    result["normal_worst_s"] / idle["normal_worst_s"], 2
                )
            kinds[kind] = result
            if not result["engine_survived"]:
                engine.stop()
                engine = Engine(model, extra, scratch)
        engine.stop()
    report(
        {
            "rate": opts.rate,
            "seconds": opts.seconds,
            "engine_args": opts.engine_args,
            "idle": idle,
            "hostile": kinds,
        },
        opts.out,
    )


if __name__ == "__main__":
    main()
