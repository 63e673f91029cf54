"""The router's connection limit (--max-connections) is its own: when long streams hold every
slot, health checks still pass and a request that finds no slot is the router's refusal (503,
Retry-After), never a failure of a worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from kubesgl.router.health import HealthSettings

pytestmark = pytest.mark.asyncio


@contextlib.asynccontextmanager
async def streams_held(
    router, engine, client: httpx.AsyncClient, count: int
) -> AsyncIterator[None]:
    """`count` streams started and paused by `engine` (its `hold`), each holding a slot."""
    hold = engine.hold
    tasks = [asyncio.create_task(_stream(client, router.url)) for _ in range(count)]
    try:
        await router.until(lambda: router.app.workers.all()[0].in_flight == count)
        yield
    finally:
        hold.set()
        await asyncio.gather(*tasks)


async def test_health_checks_pass_while_streams_hold_every_connection(
    start_router, engines, client
):
    engine = await engines("e1")
    engine.hold = asyncio.Event()  # streams pause after their first chunk
    health = HealthSettings(interval_s=0.1, timeout_s=0.5, failure_threshold=2, success_threshold=1)
    async with start_router(workers=[engine.url], max_connections=2, health=health) as router:
        await router.all_healthy()
        worker = router.app.workers.all()[0]
        async with streams_held(router, engine, client, 2):
            checks = len(engine.probe_headers)
            await asyncio.sleep(1.5)  # some fifteen checks, which the engine answers at once
            assert len(engine.probe_headers) > checks + 5
            assert worker.healthy and worker.health_failures == 0
            assert (await client.get(router.url + "/health")).status_code == 200
        upstream = router.app.forwarder.upstream
        assert upstream.control_session is not upstream.session  # room cancels' too
    # Both sessions are closed at shut-down
    assert upstream.session.closed and upstream.control_session.closed


async def test_a_request_without_a_free_connection_is_refused_by_the_router(
    start_router, engines, client
):
    engine = await engines("e1")
    engine.hold = asyncio.Event()
    health = HealthSettings(interval_s=60, timeout_s=0.5, failure_threshold=1, success_threshold=1)
    async with start_router(
        workers=[engine.url],
        max_connections=2,
        connect_timeout_s=0.3,
        health=health,
        breaker_failure_threshold=1,
    ) as router:
        await router.all_healthy()
        worker = router.app.workers.all()[0]
        async with streams_held(router, engine, client, 2):
            sent = len(engine.requests)
            third = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
            assert len(engine.requests) == sent  # never sent
            # The wait was the router's: the worker's breaker and health are untouched
            assert worker.breaker.state.value == "closed"
            assert worker.breaker.consecutive_failures == 0 and worker.healthy
            assert worker.in_flight == 2
            assert third.status_code == 503
            assert third.headers["retry-after"] == "1"
            error = third.json()["error"]
            assert error["code"] == "connection_limit" and "--max-connections" in error["message"]
        metrics = (await client.get(router.url + "/metrics")).text
        assert (
            'kubesgl_router_rejections_total{reason="connection_limit",status="503"} 1.0' in metrics
        )
        assert "kubesgl_router_retries_total 0.0" in metrics
        # The slots are free again once the streams ended
        engine.hold = None
        after = await client.post(router.url + "/v1/completions", json={"prompt": "y"})
        assert after.status_code == 200
        assert worker.in_flight == 0


async def test_a_model_list_without_a_free_connection_says_so(start_router, engines, client):
    """With workers serving different models, GET /v1/models asks one of each; a full pool
    was answered as if their workers had left it (503 no_worker)."""
    first, second = await engines("e1", model="m1"), await engines("e2", model="m2")
    for engine in (first, second):
        engine.hold = asyncio.Event()
    health = HealthSettings(interval_s=60, timeout_s=0.5, failure_threshold=1, success_threshold=1)
    async with start_router(
        workers=[first.url, second.url], max_connections=2, connect_timeout_s=0.3, health=health
    ) as router:
        await router.all_healthy()
        streams = [
            asyncio.create_task(_stream(client, router.url, model)) for model in ("m1", "m2")
        ]
        try:
            await router.until(lambda: sum(w.in_flight for w in router.app.workers.all()) == 2)
            listing = await client.get(router.url + "/v1/models")
            assert listing.status_code == 503
            assert listing.json()["error"]["code"] == "connection_limit"
        finally:
            for engine in (first, second):
                engine.hold.set()
            await asyncio.gather(*streams)


async def _stream(client: httpx.AsyncClient, url: str, model: str | None = None) -> None:
    """One streamed completion, read to its end (a model of None: the router picks)."""
    body = {"prompt": "hi", "stream": True} | ({"model": model} if model else {})
    async with client.stream("POST", url + "/v1/completions", json=body) as answer:
        async for _ in answer.aiter_bytes():
            pass
