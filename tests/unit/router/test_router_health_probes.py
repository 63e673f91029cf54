"""Checks out of turn (a new worker, the router's check signal) against the health thresholds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp import web

from kubesgl.router.health import HealthChecker, HealthSettings
from kubesgl.router.workers import Role, Worker, WorkerRegistry

PROBES = web.AppKey("probes", list[int])  # the statuses the stand-in engine answered


async def slow_engine(answers: list[int]) -> web.AppRunner:
    """An engine whose /health takes 0.2 s to answer, with `answers` in turn (200 after them),
    and appends each status it answered to `answers`' record: runner.app[PROBES]."""
    probes: list[int] = []

    async def health(_: web.Request) -> web.Response:
        status = answers.pop(0) if answers else 200
        await asyncio.sleep(0.2)  # what comes meanwhile finds this check running
        probes.append(status)
        return web.Response(status=status)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    app = web.Application()
    app[PROBES] = probes
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def run_checks(
    answers: list[int], settings: HealthSettings, step: Callable[[HealthChecker], object]
) -> tuple[list[int], Worker]:
    """The statuses the engine answered, and its worker, after `step` and 1 s."""

    async def go() -> tuple[list[int], Worker]:
        runner = await slow_engine(answers)
        workers = WorkerRegistry()
        worker = workers.add(f"http://127.0.0.1:{runner.addresses[0][1]}", Role.MIXED)
        worker.healthy = False
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker(workers, session, settings)
            result = step(checker)
            if asyncio.iscoroutine(result):
                await result
            await asyncio.sleep(1.0)
        await runner.cleanup()
        return runner.app[PROBES], worker

    return asyncio.run(go())


def test_checks_never_overlap_so_one_pass_is_one_check():
    """A round of checks that comes while the signal's check runs waits for that one: each
    started a check of its own, so one moment of passing met a success threshold that asks
    for two checks."""

    async def signal_then_round(checker: HealthChecker) -> None:
        checker.check_out_of_pool()
        await asyncio.sleep(0.05)
        await checker.check_all()

    probes, worker = run_checks([], HealthSettings(success_threshold=2), signal_then_round)
    assert probes == [200]
    assert not worker.healthy


def test_a_signal_during_a_check_checks_once_more_after_it():
    """The check running when the signal came may have asked before the engine was ready: the
    worker must not wait a whole interval (here 60 s) for the next. Signals in a burst ask for
    one check more, not one each."""

    async def signals_during_a_failing_check(checker: HealthChecker) -> None:
        checker.check_out_of_pool()
        await asyncio.sleep(0.05)
        for _ in range(3):
            checker.check_out_of_pool()

    probes, worker = run_checks(
        [503], HealthSettings(interval_s=60, failure_threshold=1), signals_during_a_failing_check
    )
    assert probes == [503, 200]
    assert worker.healthy
