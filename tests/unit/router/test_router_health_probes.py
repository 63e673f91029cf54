"""Checks out of turn (a new worker, the router's check signal) against the health thresholds."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from kubesgl.router.health import HealthChecker, HealthSettings
from kubesgl.router.workers import Role, WorkerRegistry


async def slow_engine(probes: list[str]) -> web.AppRunner:
    async def health(request: web.Request) -> web.Response:
        probes.append(request.path)
        await asyncio.sleep(0.2)  # the burst below comes while the first check is running
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def test_a_burst_of_check_signals_is_one_check_not_several_passes():
    """`kubesgl up` signals once per engine that turns ready: signals that come while a
    worker's check runs must not start more, or one moment of passing would meet a success
    threshold that asks for several checks."""

    async def burst() -> tuple[list[str], bool]:
        probes: list[str] = []
        runner = await slow_engine(probes)
        port = runner.addresses[0][1]
        workers = WorkerRegistry()
        worker = workers.add(f"http://127.0.0.1:{port}", Role.MIXED)
        worker.healthy = False
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker(workers, session, HealthSettings(success_threshold=2))
            for _ in range(3):
                checker.check_out_of_pool()
            await asyncio.sleep(0.5)
        await runner.cleanup()
        return probes, worker.healthy

    probes, healthy = asyncio.run(burst())
    assert probes == ["/health"]
    assert not healthy
