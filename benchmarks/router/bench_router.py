"""Added latency and highest request rate of `kubesgl router` vs SGLang's Rust router.

Both routers run as processes in front of the same fast fake backend (fast_backend.py,
two worker ports), with the same policy, and are driven by the same load generator:

- added latency: one request at a time; the router's p50/p99 minus the backend's own when
  called directly, so the figure is what the router adds;
- highest rate: a closed loop of --concurrency users for --duration seconds; requests/s.

The load generator is a minimal HTTP/1.1 client (see `Connection`) on uvloop.
Each in non-streaming and streaming (SSE, --chunks events) mode, for round_robin and
cache_aware. Everything shares the machine's cores, so the figures compare the routers
with each other, under the same conditions, rather than measure either in isolation.
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
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_bodies(count: int, stream: bool, seed: int = 0) -> list[bytes]:
    """Prompts with 8 shared ~600-character prefixes, so cache_aware has real work to do."""
    rng = random.Random(seed)
    prefixes = [
        f"System prompt {g}: "
        + " ".join(rng.choices("alpha beta gamma delta kv cache page".split(), k=100))
        for g in range(8)
    ]
    return [
        json.dumps(
            {
                "model": "bench",
                "prompt": f"{rng.choice(prefixes)} question {i}",
                "max_tokens": 8,
                "stream": stream,
            }
        ).encode()
        for i in range(count)
    ]


class Connection:
    """A keep-alive HTTP/1.1 connection that writes each request in one piece.

    The load generator speaks HTTP itself: Python HTTP clients write a request's head and
    body separately, and against sglang-router's streamed answers that costs ~44 ms per request
    (a small-segment/delayed-ACK stall; curl, which writes once, does not see it). Writing once
    keeps the comparison about routing work, and this client costs less CPU than aiohttp.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[float, float]:
        """(seconds to the first body byte, seconds to the last)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.transport.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
        assert self.reader is not None
        started = time.perf_counter()
        self.writer.write(
            b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (path.encode(), self.host.encode(), self.port, len(body), body)
        )
        head = (await self.reader.readuntil(b"\r\n\r\n")).lower()
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(head.split(b"\r\n")[0].decode())
        first = None
        if b"transfer-encoding: chunked" in head:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                await self.reader.readexactly(size + 2)
                first = first or time.perf_counter()
                if size == 0:
                    break
        else:
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            await self.reader.readexactly(length)
        done = time.perf_counter()
        return (first or done) - started, done - started

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def split_base(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").split(":")
    return host, int(port)


async def sequential_latency(
    base: str, stream: bool, requests: int, warmup: int
) -> dict[str, float]:
    bodies = make_bodies(requests + warmup, stream)
    connection = Connection(*split_base(base))
    try:
        for body in bodies[:warmup]:
            await connection.post("/v1/completions", body)
        samples = [await connection.post("/v1/completions", body) for body in bodies[warmup:]]
    finally:
        connection.close()
    totals = [s[1] * 1000 for s in samples]
    firsts = [s[0] * 1000 for s in samples]
    return {"p50_ms": percentile(totals, 0.5), "p99_ms": percentile(totals, 0.99),
            "first_byte_p50_ms": percentile(firsts, 0.5), "mean_ms": statistics.fmean(totals)}  # fmt: skip


async def closed_loop_rate(
    base: str, stream: bool, concurrency: int, duration: float
) -> dict[str, float]:
    bodies = make_bodies(4096, stream, seed=1)
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + duration

    async def user(index: int) -> None:
        nonlocal errors
        connection, i = Connection(*split_base(base)), index
        try:
            while time.perf_counter() < deadline:
                try:
                    latencies.append(
                        (await connection.post("/v1/completions", bodies[i % len(bodies)]))[1]
                        * 1000
                    )
                except (RuntimeError, OSError, asyncio.IncompleteReadError):
                    errors += 1
                    connection.close()
                    connection = Connection(*split_base(base))
                i += concurrency
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(user(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {"requests_per_s": len(latencies) / elapsed, "p50_ms": percentile(latencies, 0.5),
            "p99_ms": percentile(latencies, 0.99), "errors": errors}  # fmt: skip


async def wait_healthy(base: str, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[:4]} exited with {process.returncode}")
            try:
                async with session.get(base + "/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{base} never became healthy")


def router_command(kind: str, workers: list[str], policy: str, port: int) -> list[str]:
    if kind == "kubesgl":
        return [sys.executable, "-m", "kubesgl", "router", "--worker", *workers, "--policy", policy,
                "--port", str(port), "--log-level", "warning"]  # fmt: skip
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers, "--policy", policy,
            "--port", str(port), "--host", "127.0.0.1", "--log-level", "warn",
            "--prometheus-port", str(free_port())]  # fmt: skip


async def measure(args: argparse.Namespace, base: str) -> dict[str, dict[str, dict[str, float]]]:
    result = {}
    for stream in (False, True):
        mode = "streaming" if stream else "non_streaming"
        result[mode] = {
            "latency": await sequential_latency(base, stream, args.requests, args.warmup),
            "max_rate": await closed_loop_rate(base, stream, args.concurrency, args.duration),
        }
    return result


async def one_round(
    args: argparse.Namespace, workers: list[str], order: list[str]
) -> dict[str, object]:
    results: dict[str, object] = {"direct": await measure(args, workers[0])}
    for kind in order:
        for policy in args.policies:
            port = free_port()
            router = subprocess.Popen(
                router_command(kind, workers, policy, port), stdout=subprocess.DEVNULL
            )
            try:
                base = f"http://127.0.0.1:{port}"
                await wait_healthy(base, router)
                print(f"measuring {kind} {policy}", file=sys.stderr, flush=True)
                results[f"{kind}/{policy}"] = await measure(args, base)
            finally:
                router.terminate()
                router.wait(timeout=30)
    return results


def medians(rounds: list[dict[str, object]]) -> dict[str, object]:
    """Each figure's median over the rounds: robust to a round disturbed by other load."""

    def merge(values: list[object]) -> object:
        if isinstance(values[0], dict):
            return {k: merge([v[k] for v in values]) for k in values[0]}  # type: ignore[index]
        return statistics.median(values)  # type: ignore[arg-type]

    return merge(rounds)  # type: ignore[return-value]


async def main_async(args: argparse.Namespace) -> list[dict[str, object]]:
    ports = [free_port(), free_port()]
    workers = [f"http://127.0.0.1:{p}" for p in ports]
    backend = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "fast_backend.py"),
            "--ports",
            *map(str, ports),
            "--chunks",
            str(args.chunks),
        ],
        stdout=subprocess.PIPE,
    )
    assert backend.stdout is not None and backend.stdout.readline().strip() == b"ready"
    try:
        rounds = []
        for index in range(args.rounds):
            # Alternate which router goes first, so slow drifts of the machine hit both alike.
            order = list(args.routers) if index % 2 == 0 else list(reversed(args.routers))
            rounds.append(await one_round(args, workers, order))
        return rounds
    finally:
        backend.terminate()
        backend.wait(timeout=10)


def added(results: dict[str, object], key: str, mode: str, field: str) -> float:
    return results[key][mode]["latency"][field] - results["direct"][mode]["latency"][field]  # type: ignore[index]


def table(results: dict[str, object], args: argparse.Namespace) -> str:
    lines = [
        "| router / policy | mode | added p50 (ms) | added p99 (ms) | max rate (req/s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key in [k for k in results if k != "direct"]:
        for mode in ("non_streaming", "streaming"):
            rate = results[key][mode]["max_rate"]["requests_per_s"]  # type: ignore[index]
            lines.append(
                f"| {key} | {mode} | {added(results, key, mode, 'p50_ms'):.3f} | {added(results, key, mode, 'p99_ms'):.3f} | {rate:.0f} |"
            )
    for mode in ("non_streaming", "streaming"):
        direct = results["direct"][mode]  # type: ignore[index]
        lines.append(
            f"| direct (no router) | {mode} | p50 {direct['latency']['p50_ms']:.3f} | p99 {direct['latency']['p99_ms']:.3f} | {direct['max_rate']['requests_per_s']:.0f} |"
        )
    ratios = []
    for policy in args.policies:
        for mode in ("non_streaming", "streaming"):
            ours, theirs = f"kubesgl/{policy}", f"sglang/{policy}"
            if ours in results and theirs in results:
                p50 = added(results, ours, mode, "p50_ms") / max(
                    added(results, theirs, mode, "p50_ms"), 1e-9
                )
                rate = (
                    results[ours][mode]["max_rate"]["requests_per_s"]
                    / results[theirs][mode]["max_rate"]["requests_per_s"]
                )  # type: ignore[index]
                ratios.append(
                    f"{policy} {mode}: added p50 kubesgl/sglang = {p50:.2f}x, max rate kubesgl/sglang = {rate:.2f}x"
                )
    return "\n".join(lines + [""] + ratios)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--routers", nargs="+", default=["kubesgl", "sglang"], choices=["kubesgl", "sglang"]
    )
    parser.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    parser.add_argument(
        "--requests", type=int, default=1000, help="sequential requests for latency"
    )
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=64, help="users in the closed loop")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of closed loop")
    parser.add_argument("--chunks", type=int, default=8, help="SSE events per streamed answer")
    parser.add_argument("--rounds", type=int, default=3, help="figures are medians over the rounds")
    parser.add_argument("--output", default=str(HERE / "results.json"))
    args = parser.parse_args()
    import uvloop

    rounds = uvloop.run(main_async(args))
    results = medians(rounds)
    import importlib.metadata as md

    document = {
        "benchmark": "router added latency and max request rate",
        "command": "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
        "settings": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "versions": {
            name: md.version(name)
            for name in ("kubesgl", "sglang-router", "uvicorn", "httpx", "aiohttp")
        },
        "results": results,
        "rounds": rounds,
    }
    Path(args.output).write_text(json.dumps(document, indent=2) + "\n")
    print(table(results, args))


if __name__ == "__main__":
    main()
