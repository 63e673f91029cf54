"""`kubesgl serve` on a tiny model: time from start to healthy, and time to first token and
per-token latency of one streaming request at a time (so the figures are the server's own
overhead: HTTP, tokenizer process, scheduler process, detokenizer, SSE).

    python benchmarks/serve_latency.py --out benchmarks/results/serve_latency.json
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from common import free_port, report

from kubesgl.engine.models.tiny import make_tiny_model


def one_stream(client: httpx.Client, max_tokens: int) -> tuple[float, list[float]]:
    body = {
        "prompt": "The capital of France is",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    start = time.perf_counter()
    stamps = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    assert len(stamps) == max_tokens
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/serve_latency.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, "llama"))
        port = free_port()
        start = time.perf_counter()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kubesgl",
                "serve",
                "--model",
                model,
                "--port",
                str(port),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--max-total-tokens",
                "16384",
                "--log-level",
                "warning",
            ]
        )
        base = f"http://127.0.0.1:{port}"
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit("server exited during start-up")
            time.sleep(0.05)
        startup = time.perf_counter() - start
        ttfts, itls = [], []
        with httpx.Client(base_url=base, timeout=60) as client:
            one_stream(client, 8)  # warm up the HTTP path
            for _ in range(args.requests):
                ttft, gaps = one_stream(client, args.max_tokens)
                ttfts.append(ttft)
                itls += gaps
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    ms = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3  # noqa: E731
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "model": "tiny llama (make-tiny-model), float32, CPU",
        "startup_to_healthy_s": startup,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "ttft_ms_p50": ms(ttfts, 0.5),
        "ttft_ms_p99": ms(ttfts, 0.99),
        "itl_ms_p50": ms(itls, 0.5),
        "itl_ms_p99": ms(itls, 0.99),
        "itl_ms_mean": statistics.mean(itls) * 1e3,
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
