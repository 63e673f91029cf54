"""Measures the two choices on the router's hot path, each in isolation, on this machine:

1. upstream HTTP client: httpx vs aiohttp, a closed loop of requests to the fast backend
   from one process; requests/s and CPU microseconds per request (the router's budget);
2. server framework: the same trivial JSON endpoint as plain ASGI and as a FastAPI route,
   both on uvicorn (uvloop, httptools), driven by an aiohttp load generator in another
   process; requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BODY = json.dumps({"model": "bench", "prompt": "hello " * 100, "max_tokens": 8}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def drive_httpx(url: str, concurrency: int, total: int) -> None:
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as client:

        async def user(n: int) -> None:
            for _ in range(n):
                response = await client.post(
                    url, content=BODY, headers={"content-type": "application/json"}
                )
                await response.aread()

        await asyncio.gather(*(user(total // concurrency) for _ in range(concurrency)))


async def drive_aiohttp(url: str, concurrency: int, total: int) -> None:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def user(n: int) -> None:
            for _ in range(n):
                async with session.post(
                    url, data=BODY, headers={"content-type": "application/json"}
                ) as response:
                    await response.read()

        await asyncio.gather(*(user(total // concurrency) for _ in range(concurrency)))


def client_main(kind: str, url: str, concurrency: int, total: int) -> None:
    import uvloop

    drive = drive_httpx if kind == "httpx" else drive_aiohttp
    uvloop.run(drive(url, concurrency, 200))  # warm up
    wall, cpu = time.perf_counter(), time.process_time()
    uvloop.run(drive(url, concurrency, total))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(json.dumps({"requests_per_s": total / wall, "cpu_us_per_request": cpu / total * 1e6}))


async def raw_asgi(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = b'{"status":"ok"}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"15")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def fastapi_app():  # type: ignore[no-untyped-def]
    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        await request.body()
        return Response(b'{"status":"ok"}', media_type="application/json")

    return app


def server_main(kind: str, port: int) -> None:
    import uvicorn

    app = raw_asgi if kind == "asgi" else fastapi_app()
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


def run_json(args: list[str]) -> dict[str, float]:
    return json.loads(
        subprocess.run(
            [sys.executable, __file__, *args], check=True, capture_output=True, text=True
        ).stdout
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3, help="figures are medians over the rounds")
    parser.add_argument("--output", default=str(HERE / "stack_choices.json"))
    parser.add_argument("--role", choices=["client", "server"], help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "client":
        return client_main(args.kind, args.url, args.concurrency, args.requests)
    if args.role == "server":
        return server_main(args.kind, args.port)

    samples: dict[str, list[dict[str, float]]] = {}
    for _ in range(
        args.rounds
    ):  # interleaved rounds, medians below: robust to bursts of other load
        port = free_port()
        backend = subprocess.Popen(
            [sys.executable, str(HERE / "fast_backend.py"), "--ports", str(port)],
            stdout=subprocess.PIPE,
        )
        assert backend.stdout is not None and backend.stdout.readline().strip() == b"ready"
        try:
            for kind in ("httpx", "aiohttp"):
                samples.setdefault(f"client/{kind}", []).append(run_json(
                    ["--role", "client", "--kind", kind, "--url", f"http://127.0.0.1:{port}/v1/completions",
                     "--concurrency", str(args.concurrency), "--requests", str(args.requests)]))  # fmt: skip
        finally:
            backend.terminate()
            backend.wait()
        for kind in ("asgi", "fastapi"):
            port = free_port()
            server = subprocess.Popen(
                [sys.executable, __file__, "--role", "server", "--kind", kind, "--port", str(port)]
            )
            try:
                time.sleep(
                    2
                )  # a separate process: no event to wait on; /v1/completions answers once up
                samples.setdefault(f"server/{kind}", []).append(run_json(
                    ["--role", "client", "--kind", "aiohttp", "--url", f"http://127.0.0.1:{port}/v1/completions",
                     "--concurrency", str(args.concurrency), "--requests", str(args.requests)]))  # fmt: skip
            finally:
                server.terminate()
                server.wait()
    results = {
        name: {k: statistics.median(s[k] for s in runs) for k in runs[0]}
        for name, runs in samples.items()
    }
    document = {"command": "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
                "settings": vars(args), "results": results, "rounds": samples}  # fmt: skip
    Path(args.output).write_text(json.dumps(document, indent=2) + "\n")
    for name, figures in results.items():
        print(
            f"{name:16} {figures['requests_per_s']:8.0f} req/s  {figures['cpu_us_per_request']:6.0f} us CPU/request (client side)"
        )


if __name__ == "__main__":
    main()
