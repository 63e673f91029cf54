"""Fixtures for the router's integration tests: fake engines and an in-process router."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import httpx
import pytest
import pytest_asyncio
import uvicorn
from router_fakes import FakeEngine, KVTransferTable

from kubesgl.router.app import RouterApp
from kubesgl.router.config import RouterConfig
from kubesgl.router.health import HealthSettings
from kubesgl.router.routing import RetrySettings

# Fast health checks and backoffs: the tests' timeline is seconds, not minutes.
FAST = RouterConfig(
    health=HealthSettings(interval_s=0.1, timeout_s=1.0, failure_threshold=1, success_threshold=1),
    retry=RetrySettings(max_retries=3, initial_backoff_s=0.01, max_backoff_s=0.05),
    breaker_failure_threshold=2,
    breaker_cooldown_s=0.3,
    request_timeout_s=10.0,
    shutdown_timeout_s=1,
)


@contextlib.asynccontextmanager
async def serve_router(app: RouterApp) -> AsyncIterator[str]:
    """Runs the router on a free loopback port in this event loop; yields its base URL."""
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level="warning",
        timeout_graceful_shutdown=app.config.shutdown_timeout_s,  # as `kubesgl router` runs it
    )
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # listening already: early connections wait in the backlog, none is refused
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


class RouterHarness:
    def __init__(self, app: RouterApp, url: str) -> None:
        self.app = app
        self.url = url

    async def until(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        """Until `condition()` holds (checked every 10 ms); TimeoutError after `timeout` s."""
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.01)

    async def ready(self, timeout: float = 10.0) -> None:
        """Until the whole pool can serve (in P/D mode, prefill workers too: the router serves
        without them, each request by a decode worker alone)."""
        await self.until(lambda: self.app.can_serve() and self.app.degraded() is None, timeout)

    async def all_healthy(self, timeout: float = 10.0) -> None:
        workers = self.app.workers
        await self.until(
            lambda: bool(workers.all()) and all(w.healthy for w in workers.all()), timeout
        )


@pytest_asyncio.fixture
async def start_router() -> AsyncIterator[
    Callable[..., contextlib.AbstractAsyncContextManager[RouterHarness]]
]:
    @contextlib.asynccontextmanager
    async def start(**overrides: object) -> AsyncIterator[RouterHarness]:
        app = RouterApp(replace(FAST, **overrides))
        async with serve_router(app) as url:
            yield RouterHarness(app, url)

    yield start


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[Callable[..., asyncio.Future[FakeEngine]]]:
    """Starts fake engines on demand; every one still running is killed at the end."""
    started: list[FakeEngine] = []

    async def start(name: str, role: str = "mixed", **kwargs: object) -> FakeEngine:
        engine = await FakeEngine(name, role, **kwargs).start()  # type: ignore[arg-type]
        started.append(engine)
        return engine

    yield start  # type: ignore[misc]
    for engine in started:
        if engine._runner is not None:
            await engine.kill()


@pytest.fixture
def kv_table() -> KVTransferTable:
    return KVTransferTable()


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=20.0) as c:
        yield c
