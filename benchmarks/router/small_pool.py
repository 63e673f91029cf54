"""Cache-aware routing on a small pool: a worker that rejoins (issue 16, item 9).

Two `kubesgl serve` engines on the tiny llama (CPU, one thread each) behind `kubesgl router`.
The router starts with engine A alone, which serves a warm-up that puts two long system
prompts into its cache and into the router's tree; then engine B joins (POST /workers), as a
restarted engine rejoins. The measured phase sends questions behind those two system prompts,
--concurrency at a time. Per setting: the requests each engine served, the prefix-cache hit
ratio of the measured phase (the engines' own counters), the wall time and the clients'
latencies. Fresh engines for every setting and round.

    python benchmarks/router/small_pool.py --out benchmarks/router/small_pool.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ADMIN_KEY = "small-pool-bench"
WORDS = (
    "cache prefix token decode prefill router engine batch kernel tensor memory page radix schedule latency "
    "stream request worker model layer attention value key query"
).split()
# (name, router flags): SGLang's thresholds, kubesgl's defaults, and round robin for reference
SETTINGS = {
    "cache_aware abs 64 (SGLang)": ["--policy", "cache_aware", "--balance-abs-threshold", "64"],
    "cache_aware abs 4 (kubesgl)": ["--policy", "cache_aware", "--balance-abs-threshold", "4"],
    "round_robin": ["--policy", "round_robin"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def conversations(groups: int, questions: range, system_words: int) -> list[dict]:
    """Chat requests: `questions` behind each of `groups` system prompts (the same prompts for the
    same arguments), shuffled."""
    systems = [
        f"You are assistant number {g}. "
        + " ".join(random.Random(g).choices(WORDS, k=system_words))
        for g in range(groups)
    ]
    rng = random.Random(questions.start)
    requests = [
        {
            "model": "default",
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {q}: " + " ".join(rng.choices(WORDS, k=12))},
            ],
        }
        for q in questions
        for system in systems
    ]
    rng.shuffle(requests)
    return requests


def wait_healthy(url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


def engine_counters(url: str) -> tuple[float, float, float]:
    """(finished requests, prompt tokens, prompt tokens served from the cache) so far."""
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        values[base] = values.get(base, 0.0) + float(value)
    prompt = values.get("kubesgl_prompt_tokens_total", 0.0)
    return (
        values.get("kubesgl_requests_total", 0.0),
        prompt,
        prompt * values.get("kubesgl_prefix_cache_hit_ratio", 0.0),
    )


async def send_all(url: str, requests: list[dict], concurrency: int) -> list[float]:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(body: dict) -> float:
            async with semaphore:
                start = time.perf_counter()
                answer = await client.post("/v1/chat/completions", json=body)
                answer.raise_for_status()
                return time.perf_counter() - start

        return list(await asyncio.gather(*(one(body) for body in requests)))


def run_once(model: str, flags: list[str], args: argparse.Namespace, log_dir: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KUBESGL_ROUTER_ADMIN_KEY": ADMIN_KEY}
    ports = [free_port() for _ in range(2)]
    engines = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kubesgl",
                "serve",
                "--model",
                model,
                "--device",
                "cpu",
                "--port",
                str(port),
                "--max-total-tokens",
                "40000",
                "--served-model-name",
                "default",
            ],
            env=env,
            stdout=open(log_dir / f"engine-{port}.log", "w"),
            stderr=subprocess.STDOUT,
        )
        for port in ports
    ]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    router_port = free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kubesgl",
            "router",
            "--worker",
            urls[0],
            "--port",
            str(router_port),
            "--health-check-interval",
            "0.5",
            *flags,
        ],
        env=env,
        stdout=open(log_dir / f"router-{router_port}.log", "w"),
        stderr=subprocess.STDOUT,
    )
    router_url = f"http://127.0.0.1:{router_port}"
    try:
        for url in (*urls, router_url):
            wait_healthy(url)
        warm = conversations(
            args.groups, range(2), args.system_words
        )  # the prompts' first questions, on A
        asyncio.run(send_all(router_url, warm, 1))
        joined = httpx.post(
            router_url + "/workers",
            json={"url": urls[1], "role": "mixed"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
        joined.raise_for_status()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pool = httpx.get(
                router_url + "/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
            ).json()
            if all(w.get("healthy", True) for w in pool["workers"]) and len(pool["workers"]) == 2:
                break
            time.sleep(0.2)
        before = [engine_counters(url) for url in urls]
        requests = conversations(args.groups, range(2, 2 + args.questions), args.system_words)
        start = time.perf_counter()
        latencies = asyncio.run(send_all(router_url, requests, args.concurrency))
        wall = time.perf_counter() - start
        after = [engine_counters(url) for url in urls]
    finally:
        for process in (router, *engines):
            process.terminate()
        for process in (router, *engines):
            process.wait(timeout=60)
    served = [a[0] - b[0] for a, b in zip(after, before)]
    prompt = sum(a[1] - b[1] for a, b in zip(after, before))
    cached = sum(a[2] - b[2] for a, b in zip(after, before))
    ordered = sorted(latencies)
    return {
        "requests_per_engine": served,
        "prefix_hit_ratio": cached / prompt if prompt else 0.0,
        "wall_s": wall,
        "latency_p50_s": statistics.median(latencies),
        "latency_p90_s": ordered[int(0.9 * (len(ordered) - 1))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="model folder (default: a tiny llama made here)"
    )
    parser.add_argument("--groups", type=int, default=2, help="system prompts")
    parser.add_argument("--questions", type=int, default=24, help="questions per system prompt")
    parser.add_argument("--system-words", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="small-pool-"))
    model = args.model
    if model is None:
        model = str(work / "tiny")
        subprocess.run(
            [sys.executable, "-m", "kubesgl", "make-tiny-model", model, "--arch", "llama"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    rounds: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for round_ in range(args.rounds):
        for name, flags in SETTINGS.items():
            result = run_once(model, flags, args, work)
            rounds[name].append(result)
            print(f"round {round_ + 1} {name}: {json.dumps(result)}", flush=True)
    summary = {
        name: {
            key: statistics.median(r[key] for r in results)
            for key in ("prefix_hit_ratio", "wall_s", "latency_p50_s", "latency_p90_s")
        }
        | {
            "requests_per_engine": [
                statistics.median(r["requests_per_engine"][i] for r in results) for i in range(2)
            ]
        }
        for name, results in rounds.items()
    }
    report = {
        "config": vars(args),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "median_of_rounds": summary,
        "rounds": rounds,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
